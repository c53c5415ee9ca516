"""The `loraplex` command line."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import NoReturn


def _generate(args: argparse.Namespace) -> int:
    from loraplex.engine import LLM, LoRARequest, SamplingParams

    t0 = time.perf_counter()
    options = {o.name: getattr(args, o.setting) for o in _engine_flags()}
    options["device"] = options["device"] or "auto"  # as `serve`: the GPU torch sees, if any
    llm = LLM(
        args.model,
        progress=True,
        **{k: v for k, v in options.items() if v is not None},
    )
    load_s = time.perf_counter() - t0
    lora = LoRARequest("adapter", 1, args.adapter) if args.adapter else None
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    t1 = time.perf_counter()
    out = llm.generate([args.prompt], params, lora)[0].outputs[0]
    gen_s = time.perf_counter() - t1
    print(args.prompt + out.text)
    print(
        f"[{len(out.token_ids)} tokens in {gen_s:.2f}s ({len(out.token_ids) / gen_s:.1f} tok/s), "
        f"finish={out.finish_reason}, load {load_s:.1f}s]",
        file=sys.stderr,
    )
    return 0


def _prepare_demo(args: argparse.Namespace) -> int:
    from loraplex.engine import prepare_demo

    print(prepare_demo(args.data_dir, dtype=args.dtype))
    return 0


def _engine_flags():
    """The engine options `serve` and `generate` take as flags (engine/options.py)."""
    from loraplex.engine import server_options

    return [o for o in server_options() if o.flag]


def _settings(args: argparse.Namespace):
    from loraplex.platform.settings import Settings

    names = ["host", "port", "model", "stream_interval", "otlp_traces_endpoint"]
    names += ["data_plane", "vllm_urls", "vllm_agent_urls"]
    names += ["role", "disagg_prefill_urls", "disagg_decode_urls"]
    names += [o.setting for o in _engine_flags()]
    overrides = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    return Settings(**overrides)


def _db_upgrade(args: argparse.Namespace) -> int:
    from loraplex.platform.db.session import upgrade

    settings = _settings(args)
    if settings.database_url.startswith("sqlite:///"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    print(f"database at head: {settings.database_url.split('@')[-1]}")
    return 0


def _quickstart(base: str, secret: str, model: str, adapter: str | None) -> str:
    """The key and two commands that work as pasted: curl on the base model, the `openai`
    client on a demo adapter (or the base model when there is none)."""
    question = "What is the capital of Italy?"
    return f"""tenant 'demo' API key (shown once): {secret}

try it:
  curl {base}/v1/completions -H "Authorization: Bearer {secret}" \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 16}}'

  {sys.executable} -c "from openai import OpenAI; \\
c = OpenAI(base_url='{base}/v1', api_key='{secret}'); \\
print(c.chat.completions.create(model='{adapter or model}', max_tokens=32, temperature=0, \\
messages=[{{'role': 'user', 'content': '{question}'}}]).choices[0].message.content)"
"""


def serve_socket(config, send_buffer_bytes: int):
    """`serve`'s listening socket, for a uvicorn.Config it adjusts before the server loads it.

    What is written ahead of a client that stops reading sits in two buffers on our side: the
    asyncio transport's (uvicorn's `send` waits only once it is over its high-water mark,
    64 KiB by default) and the kernel's (SO_SNDBUF, autotuned to megabytes). Both are held to
    `send_buffer_bytes` (0: the defaults), so a stalled stream's backpressure reaches the
    engine (docs/security.md, "Streams whose client stops reading"). Accepted connections
    inherit the listening socket's SO_SNDBUF.
    """
    import socket

    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    sock = config.bind_socket()
    if send_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)

        class BoundedWrites(AutoHTTPProtocol):
            def connection_made(self, transport) -> None:
                transport.set_write_buffer_limits(high=send_buffer_bytes)
                super().connection_made(transport)

        config.http = BoundedWrites
    return sock


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loraplex.platform.db.session import upgrade
    from loraplex.platform.logs import setup_logging
    from loraplex.platform.main import create_app

    settings = _settings(args)
    setup_logging(settings.log_json, level=args.log_level.upper())
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    embedded = settings.database_url == f"sqlite:///{settings.data_dir / 'loraplex.db'}"
    if embedded:  # the embedded default migrates itself; shared databases need `db upgrade`
        upgrade(settings.database_url)
    if settings.role != "both":  # a prefill or decode worker (platform/disagg_worker.py)
        from loraplex.platform.disagg_worker import serve_role

        return serve_role(settings, settings.role, args.log_level)
    if args.ray:  # Ray Serve replicas, each the app below (platform/ray_serve.py)
        from loraplex.platform import ray_serve

        try:
            ray_serve.run(settings, num_replicas=args.replicas)
        except ray_serve.RayMissing as e:
            print(f"loraplex: error: {e}", file=sys.stderr)
            return 2
        return 0
    # The demo's key and quickstart commands, printed as the engine turns ready (just before
    # /readyz does), so that a command pasted at once answers instead of 503 "loading model".
    quickstart: list[str] = []

    def announce() -> None:
        if quickstart:
            print(*quickstart, flush=True)

    app = create_app(settings, on_ready=announce)
    state = app.state.lp
    base = f"http://{settings.host}:{settings.port}"
    secret, adapters = None, []
    if embedded:
        from loraplex.platform.demo.bootstrap import bootstrap_demo

        secret, adapters = bootstrap_demo(
            state, state.model_dir, adapters=settings.demo_adapters and settings.model == "demo"
        )
    if settings.admin_key is None:
        print(f"admin key (dev mode, shown once): {state.admin_key}", flush=True)
    if secret:
        quickstart.append(
            _quickstart(base, secret, state.model_name, "pirate" if adapters else None)
        )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=args.log_level,
            loop="asyncio",  # usage metering of streams reasons about asyncio's transports
            timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
            log_config=None,  # keep our handlers (JSON lines with LORAPLEX_LOG_JSON=true)
        )
    )
    fatal: list[str] = []

    def on_fatal(cause: str) -> None:
        # An engine that cannot start or has died: stop serving (in-flight requests end with
        # a clean error first) and exit non-zero, so the orchestrator restarts the process.
        fatal.append(cause)
        server.should_exit = True

    state.on_fatal = on_fatal
    # uvicorn re-raises the SIGTERM/SIGINT it handled once shutdown is complete, which would
    # end a graceful shutdown with status 143; a no-op handler beneath its own makes it 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[serve_socket(server.config, settings.stream_send_buffer_bytes)])
    if fatal:
        print(f"loraplex: error: {fatal[0]}", file=sys.stderr, flush=True)
        return 3
    return 0


def _agent(args: argparse.Namespace) -> int:
    """The adapter store comes from the same settings as the server's (LORAPLEX_STORE_URL,
    the S3 ones); nothing else of them is used."""
    import uvicorn

    from loraplex.platform.adapter_service import store_for
    from loraplex.platform.dataplane.agent import Agent
    from loraplex.platform.dataplane.agent_app import create_agent_app
    from loraplex.platform.settings import Settings

    store = store_for(Settings(dev_mode=True))  # the store settings only: no server secrets
    store.check()
    agent = Agent(args.vllm_url, store, args.cache_dir, max_bytes=args.max_bytes,
                  max_adapters=args.max_adapters)  # fmt: skip
    try:
        uvicorn.run(create_agent_app(agent), host=args.host, port=args.port, log_level="info")
    finally:
        agent.close()
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other error of the CLI (subparsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"loraplex: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole CLI's parser. It imports only the standard library (and the small
    `loraplex.bench` trace options): each command imports the engine, the registry or the
    server when it runs, so `--help` and the admin commands answer at once."""
    p = _Parser(prog="loraplex", description="multi-tenant LoRA serving")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a continuation offline")
    g.add_argument("prompt")
    g.add_argument("--model", default="demo", help="model folder, or 'demo' (Gemma 3 270M)")
    g.add_argument("--adapter", help="PEFT adapter folder to apply")
    for option in _engine_flags():
        note = "default: auto" if option.name == "device" else "default: the engine's"
        option.add_flag(g, default_note=note)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--model", help="model folder or 'demo' (default: settings)")
    for option in _engine_flags():
        option.add_flag(s)
    s.add_argument("--stream-interval", type=int, metavar="N",
                   help="tokens per streamed chunk, as vLLM's flag (default: settings, 1: a "
                   "chunk per token)")  # fmt: skip
    s.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="OTLP/HTTP collector for request traces, as vLLM's flag (default: "
                   "settings; off)")  # fmt: skip
    s.add_argument("--data-plane", choices=["embedded", "vllm"],
                   help="'embedded' (default): loraplex's engine here; 'vllm': the vLLM "
                   "servers of --vllm-url, run unchanged with --enable-lora")  # fmt: skip
    s.add_argument("--vllm-url", dest="vllm_urls", metavar="URL[,URL...]",
                   help="with --data-plane vllm: the vLLM servers (requests go to one that "
                   "has the adapter loaded)")  # fmt: skip
    s.add_argument("--vllm-agent-url", dest="vllm_agent_urls", metavar="URL[,URL...]",
                   help="the `loraplex agent` beside each vLLM, same order (default: this "
                   "server writes adapters where vLLM reads them: one host)")  # fmt: skip
    s.add_argument("--role", choices=["both", "prefill", "decode"],
                   help="'both' (default): prefill and decode here; 'prefill' / 'decode': a "
                   "worker of that role for a front (docs/disaggregation.md)")  # fmt: skip
    s.add_argument("--prefill-url", dest="disagg_prefill_urls", metavar="URL[,URL...]",
                   help="this front's prefill workers (with --decode-url)")  # fmt: skip
    s.add_argument("--decode-url", dest="disagg_decode_urls", metavar="URL[,URL...]",
                   help="this front's decode workers (with --prefill-url)")  # fmt: skip
    s.add_argument("--ray", action="store_true",
                   help="serve as a Ray Serve application multiplexed over adapters (the `ray` "
                   "extra; joins RAY_ADDRESS or starts a local cluster)")  # fmt: skip
    s.add_argument("--replicas", type=int, default=1, help="with --ray: replicas (default 1)")
    s.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="debug also logs tracebacks, e.g. of an engine that cannot start",
    )
    s.set_defaults(func=_serve)

    a = sub.add_parser("agent", help="the adapter agent beside a vLLM server (vLLM data plane)")
    a.add_argument("--vllm-url", required=True, help="this pod's vLLM, e.g. http://127.0.0.1:8000")
    a.add_argument("--cache-dir", required=True, help="where adapters are put for vLLM to read")
    a.add_argument("--max-bytes", type=int, default=8 * 1024**3,
                   help="disk the cached adapters may take (LRU ones go first)")  # fmt: skip
    a.add_argument("--max-adapters", type=int, default=64,
                   help="adapters kept registered in vLLM (LRU ones unloaded)")  # fmt: skip
    a.add_argument("--host", default="0.0.0.0")
    a.add_argument("--port", type=int, default=8100)
    a.set_defaults(func=_agent)

    db = sub.add_parser("db", help="database schema")
    dbsub = db.add_subparsers(dest="db_command", required=True)
    up = dbsub.add_parser("upgrade", help="migrate the database to the latest schema")
    up.set_defaults(func=_db_upgrade)

    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    d = msub.add_parser("prepare-demo", help="convert the bundled Gemma 3 270M (once)")
    d.add_argument("--data-dir", default=None)
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    d.set_defaults(func=_prepare_demo)

    from loraplex.platform import cli_admin, cli_batches, cli_bench, cli_reports

    cli_admin.add_commands(sub)  # tenants, keys, quotas
    cli_reports.add_commands(sub)  # adapters, usage
    cli_bench.add_commands(sub)  # bench serve
    cli_batches.add_parser(sub)  # batches (the Batch API, with a tenant key)
    return p


def _one_line_error(e: BaseException) -> str | None:
    """The message of an error a user caused, on one line; None for our own bugs."""
    from pydantic import ValidationError
    from sqlalchemy.exc import OperationalError

    from loraplex.platform.db.crud import NotFound
    from loraplex.platform.db.session import SchemaError
    from loraplex.platform.errors import APIError
    from loraplex.platform.store import StoreError

    if isinstance(e, ValidationError):  # a ValueError, but its text spans several lines
        parts = []
        for err in e.errors():
            where, msg = ".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
        return "; ".join(parts)
    if isinstance(e, OperationalError):  # unreachable server, locked or unreadable file
        reason = str(e.orig).strip().splitlines()[0] if e.orig else str(e)
        return f"cannot use the database: {reason}"
    if isinstance(e, APIError):  # the registry operations the API shares with the CLI
        return e.message
    if isinstance(e, ValueError | FileNotFoundError | NotFound | SchemaError | StoreError):
        return " ".join(str(e).split())
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:
        message = _one_line_error(e)
        if message is None:
            raise  # our own bug: the traceback is worth more than a line
        print(f"loraplex: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
