"""What a prefill worker hands a decode worker: the request, each sample's first token and
the state its sampling needs to go on exactly as one engine would have.

The KV itself does not travel in the handoff: the prompt's full blocks are in the KV tiers
(written through by the prefill worker, keyed by tokens, adapter version, tenant and base
model), and the decode worker's lookup finds them. The handoff is JSON (`to_json` /
`from_json`): no pickle crosses between workers.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field

from loraplex.engine.disagg.wire import params_from_dict, prompt_logprobs_from
from loraplex.engine.outputs import PromptLogprobs
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest


@dataclass
class FirstToken:
    """One sample's first token, as the prefill worker drew it."""

    token: int
    logprob: float | None = None  # when params.logprobs or best_of asked for them
    top: list[tuple[int, float]] = field(default_factory=list)
    generator_state: bytes | None = None  # a seeded sample's generator after the draw


@dataclass
class Handoff:
    request_id: str
    prompt: str | None  # the prompt's text, when the request gave one
    prompt_token_ids: list[int]
    params: SamplingParams  # the request's own (max_tokens and all), not the prefill's
    samples: list[FirstToken]  # one per sample (best_of or n), in index order
    lora: LoRARequest | None = None
    tenant: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefill worker found cached (usage)
    arrival_time: float = 0.0  # when the request reached the prefill worker (wall clock)
    first_token_time: float | None = None
    kv_blocks: int = 0  # full prompt blocks the prefill worker published to the tiers

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["params"] = dataclasses.asdict(self.params)
        for s in d["samples"]:
            g = s["generator_state"]
            s["generator_state"] = base64.b64encode(g).decode() if g is not None else None
        return d

    @classmethod
    def from_json(cls, text: str) -> Handoff:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: dict) -> Handoff:
        d = dict(d)
        params = params_from_dict(d.pop("params"))
        samples = [
            FirstToken(
                token=s["token"],
                logprob=s["logprob"],
                top=[(int(t), float(v)) for t, v in s["top"]],
                generator_state=base64.b64decode(g) if (g := s["generator_state"]) else None,
            )
            for s in d.pop("samples")
        ]
        lora = d.pop("lora")
        lora = LoRARequest(**lora) if lora else None
        pl = prompt_logprobs_from(d.pop("prompt_logprobs"))
        return cls(params=params, samples=samples, lora=lora, prompt_logprobs=pl, **d)
