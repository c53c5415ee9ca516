"""What each weight format frees at a fixed memory budget.

    budget = float32 weights (measured) + EXTRA (the KV / adapter share a float32 server has)
    left   = budget - this format's weights
    KV tokens that fit = whole KV blocks in `left` x block_size      (if all of it goes to KV)
    adapters that fit  = `left` // one demo adapter's bytes          (if all of it to adapters)

KV blocks are sized by the engine's own `kv_block_bytes` (float32 KV, as the bench runs; a
bf16 server holds twice the tokens), adapters by the demo adapters' host-memory bytes.
"""

from __future__ import annotations

EXTRA = 256 << 20


def budget_rows(rows: list[dict], block_bytes: int, block_size: int, adapter_bytes: int,
                extra: int = EXTRA) -> list[dict]:  # fmt: skip
    """Per format (rows of `benchmarks.quant`, the first one float32): what fits in the budget."""
    budget = rows[0]["weight_bytes"] + extra
    out = []
    for r in rows:
        left = budget - r["weight_bytes"]
        out.append({
            "format": r["format"], "weight_bytes": r["weight_bytes"], "left_bytes": left,
            "kv_tokens": left // block_bytes * block_size,
            "adapters": left // adapter_bytes,
        })  # fmt: skip
    return out


def table(doc: dict) -> str:
    m = doc["memory"]
    lines = [
        f"Budget {m['budget_bytes'] / 2**20:.0f} MiB = float32 weights + "
        f"{m['extra_bytes'] / 2**20:.0f} MiB; KV {m['block_bytes'] // m['block_size']:,} bytes "
        f"per token (float32), one demo adapter {m['adapter_bytes'] / 2**20:.2f} MiB.",
        "",
        "| format | weights (MiB) | left for KV + adapters (MiB) | KV tokens (all to KV) "
        "| demo adapters (all to adapters) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in m["rows"]:
        lines.append(
            f"| {r['format']} | {r['weight_bytes'] / 2**20:.0f} | {r['left_bytes'] / 2**20:.0f} "
            f"| {r['kv_tokens']:,} | {r['adapters']:,} |"
        )
    return "\n".join(lines)
