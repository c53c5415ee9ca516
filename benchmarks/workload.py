"""The offline workload: prompts of random token ids and the adapter mix of each scenario.

Every timed run gets its own prompt set (seeded by scenario and run index), so a prefix cache
never turns a repeat into a free prefill; both engines get exactly the same prompts per run.
Adapters are given as indices into the adapter list (None = base model), which the engines
turn into their own LoRA requests (lora_int_id = index + 1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    name: str
    label: str  # for tables and charts
    num_adapters: int  # 0 = base only
    popularity: str  # "none" | "single" | "uniform" | "zipf"
    max_loras: int  # adapter slots of the engine that runs it


@dataclass
class RunInput:
    prompts: list[list[int]]  # token ids
    adapters: list[int | None]  # adapter index per prompt


def scenarios(num_zipf: int, zipf_max_loras: int, max_loras: int = 4) -> list[Scenario]:
    return [
        Scenario("base", "base only", 0, "none", max_loras),
        Scenario("lora1", "1 adapter", 1, "single", max_loras),
        Scenario("lora4", "4 adapters mixed", 4, "uniform", max_loras),
        Scenario(f"zipf{num_zipf}", f"{num_zipf} adapters zipf", num_zipf, "zipf", zipf_max_loras),
    ]


def token_range(vocab_size: int) -> tuple[int, int]:
    """Ids to draw prompt tokens from: clear of the low special/control ids of both vocabs."""
    low = 300 if vocab_size > 1000 else 5
    return low, min(vocab_size, 200_000)


def make_run(
    sc: Scenario,
    run: int,
    *,
    num_prompts: int,
    min_len: int,
    max_len: int,
    vocab_size: int,
    zipf_alpha: float,
    seed: int,
) -> RunInput:
    rng = random.Random(f"{seed}/{sc.name}/{run}")
    lo, hi = token_range(vocab_size)
    prompts = [
        [rng.randrange(lo, hi) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_prompts)
    ]
    return RunInput(prompts, assign_adapters(sc, num_prompts, rng, zipf_alpha))


def assign_adapters(
    sc: Scenario, n: int, rng: random.Random, zipf_alpha: float
) -> list[int | None]:
    if sc.popularity == "none":
        return [None] * n
    if sc.popularity == "single":
        return [0] * n
    if sc.popularity == "uniform":
        # Exactly n / k prompts each, in random order.
        out = [i % sc.num_adapters for i in range(n)]
        rng.shuffle(out)
        return out
    if sc.popularity == "zipf":
        weights = [1.0 / (k + 1) ** zipf_alpha for k in range(sc.num_adapters)]
        return rng.choices(range(sc.num_adapters), weights=weights, k=n)
    raise ValueError(f"unknown popularity {sc.popularity!r}")
