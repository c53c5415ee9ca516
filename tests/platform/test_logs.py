"""Structured logs: one JSON object per line, request fields at the top level."""

from __future__ import annotations

import json
import logging

from loraplex.platform.logs import JsonFormatter


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
