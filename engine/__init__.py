"""loraplex data plane: many LoRA adapters batched on one base model."""

# structured_output registers the "grammar" logits-processor kind wherever the engine runs.
from loraplex.engine import structured_output  # noqa: F401
from loraplex.engine.config import EngineConfig
from loraplex.engine.llm import LLM
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]
