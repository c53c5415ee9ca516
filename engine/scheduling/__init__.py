"""Who runs this step: the scheduler, its fairness policy, and admission by KV."""
