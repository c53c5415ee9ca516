"""Seeded request traces in the shape of S-LoRA's synthetic workloads.

A trace is a list of requests, each with an arrival time, an adapter (or the base model), a
prompt of random token ids and a number of output tokens to generate:

    arrivals      Poisson (exponential gaps) or Gamma with a coefficient of variation (CV);
                  mean gap 1 / rate either way; rate inf = everything at t = 0
    adapters      power law over N adapters: P(adapter k) ∝ (k + 1) ** -alpha (alpha 0: uniform);
                  a `base_fraction` of requests uses the base model instead
    lengths       input and output lengths, each fixed ("64") or uniform on a range ("8:512")

Every aspect draws from its own seeded stream, so changing one knob (say the number of
adapters, for the scaling table) leaves the arrivals, lengths and prompts as they were.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LengthDist:
    """A length: `low` when fixed, else uniform on [low, high] (both inclusive)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length range {self.low}:{self.high}: need 1 <= low <= high")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """'64' (fixed) or '8:512' (uniform)."""
        lo, sep, hi = text.partition(":")
        try:
            return cls(int(lo), int(hi) if sep else int(lo))
        except ValueError as e:
            raise ValueError(f"length {text!r}: expected N or LOW:HIGH ({e})") from None

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class TraceConfig:
    num_requests: int = 100
    rate: float = 4.0  # requests/s on average; math.inf: all arrive at once
    arrival: str = "poisson"  # "poisson" | "gamma"
    cv: float = 1.0  # coefficient of variation of the gaps (gamma; poisson is cv 1)
    num_adapters: int = 4  # 0: base model only
    alpha: float = 1.0  # power-law exponent of adapter popularity
    base_fraction: float = 0.0  # share of requests without an adapter
    input_len: LengthDist = field(default_factory=lambda: LengthDist(8, 512))
    output_len: LengthDist = field(default_factory=lambda: LengthDist(8, 512))
    vocab_size: int = 32000  # prompt token ids are drawn below this
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not self.rate > 0:
            raise ValueError(f"rate {self.rate}: must be > 0 (inf sends everything at once)")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival {self.arrival!r}: use poisson or gamma")
        if not self.cv > 0:
            raise ValueError(f"cv {self.cv}: must be > 0")
        if self.num_adapters < 0 or self.alpha < 0:
            raise ValueError("num_adapters and alpha must be >= 0")
        if not 0 <= self.base_fraction <= 1:
            raise ValueError(f"base_fraction {self.base_fraction}: must be in [0, 1]")
        if self.num_adapters == 0 and self.base_fraction < 1:
            object.__setattr__(self, "base_fraction", 1.0)  # no adapters: all base
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")

    def describe(self) -> str:
        arrival = "all at once" if math.isinf(self.rate) else f"{self.arrival} {self.rate:g} req/s"
        if self.arrival == "gamma" and not math.isinf(self.rate):
            arrival += f" cv {self.cv:g}"
        adapters = (
            "base model only"
            if self.base_fraction >= 1
            else f"{self.num_adapters} adapters, power law alpha {self.alpha:g}"
        )
        if 0 < self.base_fraction < 1:
            adapters += f", {self.base_fraction:.0%} base"
        return (
            f"{self.num_requests} requests, {arrival}, {adapters}, "
            f"input {self.input_len} / output {self.output_len} tokens"
        )


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float  # seconds after the start of the run
    adapter: int | None  # index into the adapter list; None: the base model
    prompt: list[int]  # token ids
    max_tokens: int


def token_range(vocab_size: int) -> tuple[int, int]:
    """Ids to draw prompt tokens from: clear of the low special/control ids of real vocabs."""
    low = 300 if vocab_size > 1000 else min(5, vocab_size - 1)
    return low, vocab_size


def arrival_times(cfg: TraceConfig, rng: random.Random) -> list[float]:
    """Cumulative gaps; Gamma(shape k = 1/cv², scale = 1/(rate·k)) has mean 1/rate, CV cv."""
    if math.isinf(cfg.rate):
        return [0.0] * cfg.num_requests
    cv = 1.0 if cfg.arrival == "poisson" else cfg.cv
    shape = 1.0 / cv**2
    scale = 1.0 / (cfg.rate * shape)
    t, out = 0.0, []
    for _ in range(cfg.num_requests):
        out.append(t)
        t += rng.gammavariate(shape, scale)  # shape 1 is the exponential of Poisson arrivals
    return out


def popularity(num_adapters: int, alpha: float) -> list[float]:
    """P(adapter k) ∝ (k + 1) ** -alpha, normalised."""
    weights = [(k + 1) ** -alpha for k in range(num_adapters)]
    total = sum(weights)
    return [w / total for w in weights]


def make_trace(cfg: TraceConfig) -> list[TraceRequest]:
    def stream(name: str) -> random.Random:
        return random.Random(f"{cfg.seed}/{name}")

    arrivals = arrival_times(cfg, stream("arrivals"))
    pick, use_base = stream("adapters"), stream("base")
    lengths, tokens = stream("lengths"), stream("tokens")
    probs = popularity(cfg.num_adapters, cfg.alpha) if cfg.num_adapters else []
    lo, hi = token_range(cfg.vocab_size)
    out = []
    for i, t in enumerate(arrivals):
        base = use_base.random() < cfg.base_fraction
        choice = pick.choices(range(cfg.num_adapters), weights=probs)[0] if probs else None
        n_in, n_out = cfg.input_len.sample(lengths), cfg.output_len.sample(lengths)
        prompt = [tokens.randrange(lo, hi) for _ in range(n_in)]
        out.append(TraceRequest(i, t, None if base else choice, prompt, n_out))
    return out
