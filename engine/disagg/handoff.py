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
        d = dataclasses.asdict(self)
        d["params"] = dataclasses.asdict(self.params)
        for s in d["samples"]:
            g = s["generator_state"]
            s["generator_state"] = base64.b64encode(g).decode() if g is not None else None
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Handoff:
        d = json.loads(text)
        p = d.pop("params")
        if p.get("logit_bias"):  # JSON object keys are strings
            p["logit_bias"] = {int(k): v for k, v in p["logit_bias"].items()}
        params = SamplingParams(**p)
        samples = []
        for s in d.pop("samples"):
            g = s["generator_state"]
            samples.append(
                FirstToken(
                    token=s["token"],
                    logprob=s["logprob"],
                    top=[(int(t), float(v)) for t, v in s["top"]],
                    generator_state=base64.b64decode(g) if g is not None else None,
                )
            )
        lora = LoRARequest(**d.pop("lora")) if d.get("lora") else d.pop("lora", None)
        pl = d.pop("prompt_logprobs")
        if pl is not None:
            pl = PromptLogprobs(
                token_logprobs=pl["token_logprobs"],
                ranks=pl["ranks"],
                top=[None if t is None else [(int(a), float(b)) for a, b in t] for t in pl["top"]],
            )
        return cls(params=params, samples=samples, lora=lora, prompt_logprobs=pl, **d)
