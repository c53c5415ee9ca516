"""Offline batch generation in vLLM's style: `LLM(...).generate(prompts, params, lora_request)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path

from tqdm import tqdm

from loraplex.engine.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.models.tokenizer import Tokenizer
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest


def resolve_model(model: str, data_dir: Path | None = None) -> str:
    """The model folder `model` names: `demo` is the bundled Gemma 3 270M, converted on first
    use (under `data_dir`, default the user's cache); anything else is a folder already.
    The one resolver for the offline API, the CLI and the server."""
    if model == "demo":
        from loraplex.engine.models.demo import prepare_demo

        return str(prepare_demo(data_dir))
    return model


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        max_loras: int = 4,
        max_lora_rank: int = 64,
        quantization: str | None = None,
        progress: bool = False,
        **engine_options,
    ):
        config = EngineConfig(
            model=resolve_model(model),
            dtype=dtype,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            quantization=quantization,
            **engine_options,
        )
        self.engine = LLMEngine(config, progress=progress)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        loras = _per_prompt(lora_request, n, "lora_request")
        ids = [f"gen-{next(self._ids)}" for _ in range(n)]
        engine = self.engine
        try:
            for rid, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
                engine.add_request(rid, prompt, p, lora)
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, desc="generating", disable=not use_tqdm)
        while len(done) < n:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in ids]


def _per_prompt(value, n: int, what: str) -> list:
    if value is None or isinstance(value, SamplingParams | LoRARequest):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{what}: got {len(value)} entries for {n} prompts")
    return value
