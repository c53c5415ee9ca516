"""PNG charts of serving runs (matplotlib, headless).

plot_run: one run, four panels: TTFT CDF, TPOT CDF, E2E latency against arrival time, and
output tokens/s over time (1 s bins). plot_compare: several systems or settings side by side
(throughput bars, TTFT p50/p99 bars).
"""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], label: str | None = None) -> None:
    xs = sorted(v * 1000 for v in values)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def plot_run(doc: dict, path: Path) -> Path:
    plt = _plt()
    reqs = [r for r in doc["requests"] if r["error"] is None and r["end_s"] is not None]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    (a1, a2), (a3, a4) = axes
    _cdf(a1, [r["ttft"] for r in reqs if r["ttft"] is not None])
    a1.set(xlabel="TTFT (ms)", ylabel="share of requests", title="time to first token")
    _cdf(a2, [r["tpot"] for r in reqs if r["tpot"] is not None])
    a2.set(xlabel="TPOT (ms)", ylabel="share of requests", title="time per output token")
    a3.scatter([r["start_s"] for r in reqs], [r["e2e"] * 1000 for r in reqs], s=6)
    a3.set(xlabel="sent at (s)", ylabel="end-to-end latency (ms)", title="latency over the run")
    times = [t for r in reqs for t in r["token_times"]]
    if times:
        # Chunks, not tokens: both servers stream one token per chunk in these runs.
        bins = max(1, int(max(times)) + 1)
        a4.hist(times, bins=bins, range=(0, bins))
    a4.set(xlabel="time (s)", ylabel="streamed chunks per second", title="output over time")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    s = doc["summary"]
    fig.suptitle(
        f"{doc['kind']}: {doc['trace']['description']}\n"
        f"{s['completed']}/{s['requests']} ok, {s['output_throughput'] or 0:.1f} output tok/s",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_compare(rows: list[dict], path: Path, title: str, xlabel: str) -> Path:
    """rows: {"label", "output_throughput", "ttft_p50", "ttft_p99"} (seconds for TTFT)."""
    plt = _plt()
    labels = [r["label"] for r in rows]
    xs = range(len(rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = a1.bar(xs, [r["output_throughput"] or 0 for r in rows])
    a1.bar_label(bars, fmt="%.0f", fontsize=8)
    a1.set(ylabel="output tokens/s", title="throughput", xlabel=xlabel)
    w = 0.4
    for k, key in enumerate(("ttft_p50", "ttft_p99")):
        vals = [(r[key] or 0) * 1000 for r in rows]
        bars = a2.bar([x + (k - 0.5) * w for x in xs], vals, w, label=key.replace("_", " "))
        a2.bar_label(bars, fmt="%.0f", fontsize=7)
    a2.set(ylabel="ms", title="time to first token", xlabel=xlabel)
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
