"""The engine's errors, as types: what went wrong decides what the caller answers (the server
maps each type to an HTTP status in one table, platform/api/errors.py), never the text of a
message. They cross the engine process's pipe by type name with their fields
(engine/process/engine_process.py), so the server sees the same types whether the engine runs in its
process or in another.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the errors the engine raises on purpose."""


class BadRequestError(EngineError, ValueError):
    """The request cannot be served as asked (a parameter outside what this model allows: its
    vocabulary, its context length). `param` names the request field, where one is to blame.
    A ValueError, so that code written against plain ValueErrors keeps working."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class AdapterError(EngineError, ValueError):
    """An adapter that cannot be served; the message says why."""


class NonFiniteOutput(AdapterError):
    """A request's logits or logprobs came out NaN or infinite (an adapter of absurd
    magnitude): that request ends with this error; the rows beside it in the batch are
    unaffected. An AdapterError: the server answers 422 invalid_adapter (docs/security.md)."""


class AdapterUnavailable(EngineError, RuntimeError):
    """An adapter's files could not be read (disk or store trouble, not a bad adapter)."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine stopped on an internal error; requests cannot be served."""


class EngineBusy(EngineError, RuntimeError):
    """The engine takes no more requests now: as many wait to be handed to it as the server
    allows (an engine that stopped reading its commands). Retrying later may work."""


# What crosses the engine process's pipe by name (anything else arrives as RuntimeError).
BY_NAME: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        BadRequestError,
        AdapterError,
        NonFiniteOutput,
        AdapterUnavailable,
        EngineDeadError,
        ValueError,
    )
}


def to_message(e: BaseException) -> tuple[str, str, str | None]:
    """(type name, message, param) of an error, for the pipe."""
    name = type(e).__name__
    return (name if name in BY_NAME else "RuntimeError", str(e), getattr(e, "param", None))


def from_message(name: str, message: str, param: str | None = None) -> Exception:
    cls = BY_NAME.get(name, RuntimeError)
    return cls(message, param) if cls is BadRequestError else cls(message)
