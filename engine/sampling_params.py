"""Per-request decoding options, in the shape users know from vLLM's `SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.engine.errors import BadRequestError

# Below this a temperature divides logits into overflow; such requests are decoded greedily.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_N = 16  # completions per request (n, best_of): each holds a running sequence
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop; checks itself on construction.

    `temperature=0` (or `top_k=1`) decodes greedily. Penalties follow OpenAI
    (`presence_penalty`, `frequency_penalty`: generated tokens only) and Hugging Face
    (`repetition_penalty`: prompt and generated tokens, positive logits divided, negative
    multiplied). `stop` and `stop_token_ids` are normalised to lists.
    """

    n: int = 1  # completions returned
    best_of: int | None = None  # completions generated (>= n), the n best by cumulative logprob
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # per prompt position: the prompt token's logprob and this many alternatives (vLLM's);
    # such a request computes its whole prompt (no prefix-cache hits before it is scored)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # special tokens (by text) left in the text although skip_special_tokens: e.g. the tool-call
    # marker a Mistral tokenizer marks special (`[TOOL_CALLS]`), which the tools parser reads
    kept_special_tokens: list[str] | None = None
    # token id -> bias added to its logit, clamped to [-100, 100] (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # specs of registered logits processors, `{"kind": ..., ...}`
    # (engine/sampling/logits_processors.py)
    logits_processors: list[dict] | None = None
    # a secret in the prefix cache's keys (device pool and KV tiers): only requests with the
    # same salt share cached KV. The platform sets its tenant's (platform/db/cache_salts.py)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self._normalise_stops()
        self._normalise_processors()
        self._check_ranges()

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax of the penalised logits (no randomness used)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def num_samples(self) -> int:
        """Sequences generated for the request: best_of, or n."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def _check_types(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if not _is_number(value):
                raise BadRequestError(f"{name} must be a number, got {value!r}", param=name)
            setattr(self, name, float(value))
        for name, optional in (
            ("n", False),
            ("best_of", True),
            ("top_k", False),
            ("min_tokens", False),
            ("max_tokens", True),
            ("logprobs", True),
            ("prompt_logprobs", True),
            ("seed", True),
        ):
            value = getattr(self, name)
            if not (_is_int(value) or (optional and value is None)):
                allowed = "an integer or None" if optional else "an integer"
                raise BadRequestError(f"{name} must be {allowed}, got {value!r}", param=name)
        if not (self.cache_salt is None or isinstance(self.cache_salt, str)):
            raise BadRequestError(
                f"cache_salt must be a string or None, got {self.cache_salt!r}", param="cache_salt"
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise BadRequestError(
                    f"{name} must be true or false, got {getattr(self, name)!r}", param=name
                )

    def _normalise_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, list | tuple):
            stop = list(stop)
        else:
            raise BadRequestError(
                f"stop must be a string or a list of strings, got {stop!r}", param="stop"
            )
        for s in stop:
            if not isinstance(s, str) or not s:
                raise BadRequestError(
                    f"stop must contain only non-empty strings, got {s!r}; "
                    "remove it or use stop_token_ids for token ids",
                    param="stop",
                )
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, list | tuple):
            ids = list(ids)
        else:
            raise BadRequestError(
                f"stop_token_ids must be a list of token ids, got {ids!r}", param="stop_token_ids"
            )
        for t in ids:
            if not _is_int(t) or t < 0:
                raise BadRequestError(
                    f"stop_token_ids must be non-negative integers, got {t!r}",
                    param="stop_token_ids",
                )
        self.stop_token_ids = ids
        kept = self.kept_special_tokens
        if kept is not None and (
            not isinstance(kept, list | tuple) or not all(isinstance(t, str) and t for t in kept)
        ):
            raise BadRequestError(
                f"kept_special_tokens must be a list of token texts, got {kept!r}",
                param="kept_special_tokens",
            )
        self.kept_special_tokens = list(kept) if kept else None

    def _normalise_processors(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise BadRequestError(
                    f"logit_bias must map token ids to numbers, got {bias!r}", param="logit_bias"
                )
            out: dict[int, float] = {}
            for key, value in bias.items():
                # JSON object keys are strings: "50256" names token 50256.
                if isinstance(key, str) and key.isdigit():
                    key = int(key)
                if not _is_int(key) or key < 0:
                    raise BadRequestError(
                        f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                    )
                if not _is_number(value) or value != value:
                    raise BadRequestError(
                        f"logit_bias values must be numbers, got {value!r}", param="logit_bias"
                    )
                out[key] = float(value)
            self.logit_bias = out or None
        procs = self.logits_processors
        if procs is not None:
            if not isinstance(procs, list | tuple) or not all(
                isinstance(p, dict) and isinstance(p.get("kind"), str) for p in procs
            ):
                raise BadRequestError(
                    'logits_processors must be a list of specs like {"kind": "...", ...}',
                    param="logits_processors",
                )
            self.logits_processors = list(procs) or None

    @property
    def has_processors(self) -> bool:
        return bool(self.logit_bias or self.logits_processors)

    def _check_ranges(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise BadRequestError(f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_N:
            raise BadRequestError(
                f"best_of must be between n ({self.n}) and {MAX_N}, got {self.best_of}",
                param="best_of",
            )
        if self.temperature < 0:
            raise BadRequestError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}",
                param="temperature",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequestError(
                f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to turn nucleus sampling off",
                param="top_p",
            )
        if self.top_k < -1:
            raise BadRequestError(
                f"top_k must be >= 1, or 0 / -1 to turn it off, got {self.top_k}", param="top_k"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequestError(
                f"min_p must be in [0, 1] (0 turns it off), got {self.min_p}", param="min_p"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise BadRequestError(
                    f"{name} must be in [-2, 2] (0 turns it off), got {getattr(self, name)}",
                    param=name,
                )
        if self.repetition_penalty <= 0:
            raise BadRequestError(
                f"repetition_penalty must be > 0 (1 turns it off), got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        if self.max_tokens is not None and self.max_tokens < 0:
            raise BadRequestError(
                f"max_tokens must be >= 1 (0: compute the prompt only, as for its "
                f"prompt_logprobs), or None to generate up to the context limit, "
                f"got {self.max_tokens}",
                param="max_tokens",
            )
        if self.max_tokens == 0 and self.best_of not in (None, self.n):
            raise BadRequestError(
                "best_of ranks generated samples: it needs max_tokens >= 1", param="best_of"
            )
        if self.min_tokens < 0:
            raise BadRequestError(
                f"min_tokens must be >= 0, got {self.min_tokens}", param="min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise BadRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                f"({self.max_tokens}); raise max_tokens or lower min_tokens",
                param="min_tokens",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequestError(
                f"logprobs must be between 0 and {MAX_LOGPROBS} (0 returns only the chosen "
                f"token's), got {self.logprobs}",
                param="logprobs",
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise BadRequestError(
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS} (0 returns only each "
                f"prompt token's), got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]:
            raise BadRequestError(f"seed must fit in 64 bits, got {self.seed}", param="seed")
