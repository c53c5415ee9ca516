"""loraplex data plane: many LoRA adapters batched on one base model.

The engine's public API: what an embedder (and loraplex's own server, platform/) uses. The
modules behind it may move; these names stay. Names load on first use, so importing
`loraplex.engine` (or its light `options` module, as the CLI does for `--help`) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    # running the engine
    "LLM": "llm",
    "resolve_model": "llm",
    "LLMEngine": "llm_engine",
    "AsyncLLMEngine": "process.async_engine",
    "StreamingEngine": "process.async_engine",
    "EngineProcess": "process.engine_process",
    "keep_freed_memory": "memory.host_malloc",
    # prefill and decode on different workers (docs/disaggregation.md)
    "PrefillWorker": "disagg.workers",
    "DecodeWorker": "disagg.workers",
    "Handoff": "disagg.handoff",
    "output_to_dict": "disagg.wire",
    "output_from_dict": "disagg.wire",
    "request_to_dict": "disagg.wire",
    "request_from_dict": "disagg.wire",
    # configuration
    "EngineConfig": "config",
    "EngineOptions": "options",
    "ServerOption": "options",
    "server_options": "options",
    # requests and answers
    "SamplingParams": "sampling_params",
    "MAX_LOGPROBS": "sampling_params",
    "MAX_N": "sampling_params",
    "LoRARequest": "sequence",
    "PRIORITY_INTERACTIVE": "sequence",
    "PRIORITY_BATCH": "sequence",
    "RequestOutput": "outputs",
    "CompletionOutput": "outputs",
    "PromptLogprobs": "outputs",
    "RequestMetrics": "outputs",
    "FinishReason": "outputs",
    "EngineStats": "stats",
    "ADAPTER_LOAD_BUCKETS": "stats",
    "grammar_spec": "sampling.structured_output",
    # the model and its adapters
    "ModelSpec": "models.spec",
    "spec_from_config": "models.spec",
    "PROJECTIONS": "models.spec",
    "Tokenizer": "models.tokenizer",
    "load_adapter": "adapters.lora",
    "read_adapter_config": "adapters.lora",
    "check_adapter_layers": "adapters.lora",
    "prepare_demo": "models.demo",
    # errors (engine/errors.py)
    "EngineError": "errors",
    "BadRequestError": "errors",
    "AdapterError": "errors",
    "NonFiniteOutput": "errors",
    "AdapterUnavailable": "errors",
    "EngineDeadError": "errors",
    "EngineBusy": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loraplex.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"loraplex.engine.{module}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
