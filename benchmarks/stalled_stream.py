"""Compute spent on a stream whose client stops reading: before vs after backpressure.

    python -m benchmarks.stalled_stream [--tokens 4096] [--stall-s 60]

A server as `loraplex serve` makes it (tiny Llama, engine in its own process) streams one
`--tokens` completion (ignore_eos) to a client that connects, sends the request and then
reads nothing for `--stall-s` seconds. Per configuration it reports the tokens the engine
generated meanwhile, the tokens written to the connection (what the client is billed for)
and the bytes the client can then read at once (its socket's share of them). "unbounded" is
the behaviour without backpressure (no pause window, the kernel's autotuned send buffer);
"bounded" is the default settings.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from pathlib import Path

CONFIGS = {
    # No pause and autotuned socket buffers: what a stalled stream cost before.
    "unbounded": {"stream_window_tokens": 10**9, "stream_send_buffer_bytes": 0},
    "bounded": {},  # the defaults
}


def _run(model: Path, data: Path, tokens: int, stall_s: float, overrides: dict) -> dict:
    from loraplex.platform.settings import Settings
    from testkit.server import free_port, serve_in_thread

    port = free_port()
    settings = Settings(
        data_dir=data, model=str(model), host="127.0.0.1", port=port, dtype="float32",
        max_model_len=tokens + 64, stream_stall_timeout_s=stall_s + 60, **overrides,
    )  # fmt: skip
    with serve_in_thread(settings, timeout_s=600) as (app, url):
        return _measure(app, url, port, tokens, stall_s)


def _measure(app, url: str, port: int, tokens: int, stall_s: float) -> dict:

    from loraplex.platform.db import crud

    state = app.state.lp
    with state.sessions() as session:
        tenant = crud.create_tenant(session, name="stalled")
        secret, _ = crud.create_key(session, tenant_id=tenant.id)
    request = {"model": state.model_name, "prompt": "The quick brown", "stream": True,
               "max_tokens": tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip
    body = json.dumps(request).encode()
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {secret}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    before = state.engine.stats().generated_tokens
    start = time.monotonic()
    job = None
    while time.monotonic() - start < stall_s:
        job = job or next(iter(state.streams.values()), None)
        time.sleep(0.1)
    stats = state.engine.stats()
    row = {
        "generated_tokens": stats.generated_tokens - before,
        "written_tokens": job.sent_tokens if job else None,
        "paused": stats.paused,
    }
    # What the socket buffers hold: everything the client can read without the server's help.
    client.setblocking(False)
    held = 0
    try:
        while chunk := client.recv(1 << 20):
            held += len(chunk)
    except BlockingIOError:
        pass
    row["written_bytes"] = held
    client.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--stall-s", type=float, default=60.0)
    args = p.parse_args()
    from benchmarks.assets import factories

    make_tiny_model = factories().make_tiny_model
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            "llama", Path(tmp) / "llama", max_position_embeddings=args.tokens + 64
        )
        for name, overrides in CONFIGS.items():
            row = _run(model, Path(tmp) / name, args.tokens, args.stall_s, overrides)
            print(json.dumps({"config": name, "tokens": args.tokens, "stall_s": args.stall_s,
                              **row}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
