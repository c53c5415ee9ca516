"""The poller's view of a vLLM server, against a real HTTP server answering vLLM's /health,
/v1/models and /metrics: a server that refuses is down at once; one that answers late (a busy
host) stays up until it has missed MISSES_TO_DOWN polls in a row."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from loraplex.platform.dataplane.vllm import MISSES_TO_DOWN, VllmDataPlane

ANSWERS = {
    "/health": b"",
    "/v1/models": json.dumps(
        {
            "data": [
                {"id": "base", "parent": None, "max_model_len": 256},
                {"id": "lpx-1", "parent": "base"},
            ]
        }
    ).encode(),  # fmt: skip
    "/metrics": b'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_waiting 1.0\n',
}


class Vllm(BaseHTTPRequestHandler):
    delay_s = 0.0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        time.sleep(type(self).delay_s)
        body = ANSWERS[self.path]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_late_answer_is_not_a_server_down(plane_model):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Vllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    plane = VllmDataPlane([f"http://127.0.0.1:{server.server_address[1]}"], plane_model,
                          loader=lambda *_: None)  # fmt: skip
    plane._http = httpx.Client(timeout=0.2)
    (e,) = plane.endpoints
    try:
        plane.poll_once()
        assert e.healthy and e.loaded == {"lpx-1"} and (e.running, e.waiting) == (2, 1)
        Vllm.delay_s = 0.5  # past the poll's timeout
        for _ in range(MISSES_TO_DOWN - 1):
            plane.poll_once()
            assert e.healthy and plane.unavailable() is None
        plane.poll_once()
        assert not e.healthy and "no vLLM endpoint" in plane.unavailable()
        Vllm.delay_s = 0.0
        plane.poll_once()
        assert e.healthy and e.misses == 0
        Vllm.delay_s = 0.5
        plane.poll_once()  # one late answer again: still up
        assert e.healthy
    finally:
        Vllm.delay_s = 0.0
        server.shutdown()
        server.server_close()
    plane.poll_once()  # refused: down at once
    assert not e.healthy
    plane._http.close()
