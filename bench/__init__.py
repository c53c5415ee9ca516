"""`loraplex bench serve`: a seeded trace replayed against any OpenAI-compatible server.

    trace.py     seeded request traces: arrivals, adapter popularity, input/output lengths
    metrics.py   per-request timings -> throughput, TTFT/TPOT/latency percentiles, SLOs
    client.py    one streamed OpenAI completion, timed token by token
    targets.py   where a trace goes: an OpenAI-compatible server, or our engine in-process
    replay.py    plays a trace against a target on its arrival schedule
    serve.py     `loraplex bench serve`: options, run, JSON (+ PNG with matplotlib)
    plots.py     the PNG of a serving run
    sysinfo.py   the machine a result was measured on

The lab (peer comparisons, sweeps, the benchmarks page) is the checkout's benchmarks/ folder,
which builds on these modules and is not installed.
"""
