"""Outputs and requests between a front and its prefill / decode workers, as JSON (no
pickle crosses between processes)."""

from __future__ import annotations

import dataclasses

from loraplex.engine.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest


def _pairs(top) -> list[tuple[int, float]] | None:
    return None if top is None else [(int(t), float(v)) for t, v in top]


def prompt_logprobs_from(d: dict | None) -> PromptLogprobs | None:
    if d is None:
        return None
    return PromptLogprobs(d["token_logprobs"], d["ranks"], [_pairs(t) for t in d["top"]])


def output_to_dict(out: RequestOutput) -> dict:
    d = dataclasses.asdict(out)
    for c in d["outputs"]:  # JSON object keys are strings: token ids as [id, logprob] pairs
        if c["logprobs"] is not None:
            c["logprobs"] = [list(e.items()) for e in c["logprobs"]]
    return d


def output_from_dict(d: dict) -> RequestOutput:
    d = dict(d)
    outputs = []
    for c in d.pop("outputs"):
        if c["logprobs"] is not None:
            c["logprobs"] = [{int(t): float(v) for t, v in e} for e in c["logprobs"]]
        outputs.append(CompletionOutput(**c))
    metrics = d.pop("metrics")
    pl = prompt_logprobs_from(d.pop("prompt_logprobs"))
    return RequestOutput(
        outputs=outputs,
        prompt_logprobs=pl,
        metrics=RequestMetrics(**metrics) if metrics is not None else None,
        **d,
    )


def params_from_dict(p: dict) -> SamplingParams:
    if p.get("logit_bias"):  # JSON object keys are strings
        p = {**p, "logit_bias": {int(k): v for k, v in p["logit_bias"].items()}}
    return SamplingParams(**p)


def request_to_dict(request_id: str, prompt_ids: list[int], params: SamplingParams,
                    lora: LoRARequest | None, tenant: str | None) -> dict:  # fmt: skip
    return {
        "request_id": request_id,
        "prompt_token_ids": list(prompt_ids),
        "params": dataclasses.asdict(params),
        "lora": dataclasses.asdict(lora) if lora is not None else None,
        "tenant": tenant,
    }


def request_from_dict(d: dict) -> tuple[str, list[int], SamplingParams, LoRARequest | None,
                                        str | None]:  # fmt: skip
    lora = LoRARequest(**d["lora"]) if d.get("lora") else None
    return (d["request_id"], [int(t) for t in d["prompt_token_ids"]],
            params_from_dict(d["params"]), lora, d.get("tenant"))  # fmt: skip
