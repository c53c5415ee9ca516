"""What a remote data plane raises beyond the engine's own errors (engine/errors.py)."""

from __future__ import annotations

from loraplex.engine import BadRequestError, EngineError


class DataPlaneUnavailable(EngineError, RuntimeError):
    """No vLLM endpoint can take the request now (down, restarting, unreachable), or the one
    serving it went away mid-stream. Retrying later may work: 503 with Retry-After."""

    retry_after_s = 5


class Unsupported(BadRequestError):
    """A request field this data plane cannot honour: refused by name, never ignored."""

    def __init__(self, what: str, param: str | None = None, data_plane: str = "vllm"):
        super().__init__(f"{what} is not supported by the {data_plane} data plane", param)
