"""Logging: one JSON object per line for log collectors, or plain lines for a terminal."""

from __future__ import annotations

import json
import logging
import re
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
# Values of these characters print bare; anything else (a space, a quote, a newline in a
# client-chosen `user`) is JSON-quoted, so no field can forge a line or a `key=value` of its own.
_BARE = re.compile(r"[\w.:/@+-]+")
# uvicorn's copy of its message with terminal colours: the message itself is already there.
_PLAIN_SKIPPED = {"color_message"}


def _extra(record: logging.LogRecord) -> dict[str, object]:
    """The fields passed with `extra=` (request id, tenant, tokens...), in the order given."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


def _plain(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        value = round(value, 1)
    text = str(value)
    return text if _BARE.fullmatch(text) else json.dumps(text)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # Fields passed with `extra=` become top-level keys.
        entry.update(_extra(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class PlainFormatter(logging.Formatter):
    """A terminal's line: time, level, logger, message, then the `extra=` fields as `key=value`
    (the request line's id, tenant, model, status and tokens are in the default logs too)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # The traceback, if any, is appended after this: the fields stay on the first line.
        fields = [f"{k}={_plain(v)}" for k, v in _extra(record).items() if k not in _PLAIN_SKIPPED]
        return " ".join([super().formatMessage(record), *fields])


def setup_logging(json_logs: bool, level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_logs else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []  # let them propagate to the root handler
        logging.getLogger(name).propagate = True
