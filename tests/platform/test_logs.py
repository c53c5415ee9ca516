"""Logs: one JSON object per line with the request fields at the top level, or plain lines
with the same fields as `key=value`."""

from __future__ import annotations

import json
import logging
import sys

from loraplex.platform.logs import JsonFormatter, PlainFormatter


def test_json_lines_carry_extra_fields():
    record = logging.makeLogRecord(
        {
            "name": "loraplex.requests",
            "levelno": logging.INFO,
            "levelname": "INFO",
            "msg": "request %s",
            "args": ("finished",),
            "request_id": "cmpl-1",
            "tenant_id": 7,
            "completion_tokens": 12,
        }
    )
    entry = json.loads(JsonFormatter().format(record))
    assert entry["msg"] == "request finished" and entry["level"] == "info"
    assert entry["request_id"] == "cmpl-1" and entry["tenant_id"] == 7
    assert entry["completion_tokens"] == 12 and entry["ts"].endswith("Z")
    assert "args" not in entry and "levelno" not in entry


def _request_record(**fields) -> logging.LogRecord:
    return logging.makeLogRecord(
        {
            "name": "loraplex.requests",
            "levelno": logging.INFO,
            "levelname": "INFO",
            "msg": "request finished",
            **fields,
        }
    )


def test_plain_lines_carry_the_request_fields_on_one_line():
    record = _request_record(
        request_id="cmpl-1", tenant_id=7, model="sql@v2", end_user="ann\nINFO forged: x=1",
        status="ok", prompt_tokens=5, completion_tokens=12, ttft_ms=12.3456, queue_ms=None,
        color_message="\x1b[32mrequest finished\x1b[0m",
    )  # fmt: skip
    line = PlainFormatter().format(record)
    assert "\n" not in line and "\x1b" not in line
    head, fields = line.split(" INFO loraplex.requests: request finished ")
    assert fields == (
        'request_id=cmpl-1 tenant_id=7 model=sql@v2 end_user="ann\\nINFO forged: x=1" status=ok '
        "prompt_tokens=5 completion_tokens=12 ttft_ms=12.3 queue_ms=-"
    )


def test_plain_lines_keep_a_traceback_below_the_fields():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = _request_record(request_id="cmpl-2", exc_info=sys.exc_info())
    first, *rest = PlainFormatter().format(record).splitlines()
    assert first.endswith("request finished request_id=cmpl-2")
    assert rest[0].startswith("Traceback") and rest[-1] == "RuntimeError: boom"
