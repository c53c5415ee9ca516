"""`benchmarks.quant`'s memory table: what a format's smaller weights free at a fixed budget is what
an engine given those bytes really holds (KV tokens), with adapters sized as the engine holds
them in host memory."""

from __future__ import annotations

from benchmarks.quant_adapters import load_into_slot
from benchmarks.quant_memory import budget_rows
from loraplex.engine import LLM
from loraplex.engine.step.model_runner import kv_block_bytes

EXTRA = 1 << 20


def _llm(model, quantization=None, kv_cache_bytes=EXTRA) -> LLM:
    return LLM(str(model), dtype="float32", quantization=quantization, max_loras=1,
               max_lora_rank=8, kv_cache_bytes=kv_cache_bytes, max_num_seqs=4096)  # fmt: skip


def test_budget_rows_match_what_an_engine_holds_in_the_freed_bytes(tiny_models, tiny_adapters):
    model = tiny_models["llama"]
    engines = {"float32": _llm(model), "int8": _llm(model, "int8")}
    _, adapter_bytes = load_into_slot(engines["float32"], "qv4", tiny_adapters["llama"]["qv4"], 1)
    block_bytes = kv_block_bytes(engines["float32"].engine.model, 16)
    rows = [{"format": f, "weight_bytes": e.engine.memory.weight_bytes} for f, e in engines.items()]
    table = {r["format"]: r for r in budget_rows(rows, block_bytes, 16, adapter_bytes, EXTRA)}

    assert table["float32"]["left_bytes"] == EXTRA
    freed = rows[0]["weight_bytes"] - rows[1]["weight_bytes"]
    assert freed > 0 and table["int8"]["left_bytes"] == EXTRA + freed
    assert table["int8"]["kv_tokens"] > table["float32"]["kv_tokens"]
    assert table["int8"]["adapters"] > table["float32"]["adapters"]
    for fmt, r in table.items():
        # An engine whose KV budget is what is left (plus its own slot's bytes, carved first)
        # holds exactly the tokens the table says.
        slot = engines[fmt].engine.memory.adapter_slot_bytes
        held = _llm(model, None if fmt == "float32" else fmt, r["left_bytes"] + slot)
        assert held.engine.memory.kv_cache_tokens == r["kv_tokens"]
        assert (
            r["adapters"] * adapter_bytes <= r["left_bytes"] < (r["adapters"] + 1) * adapter_bytes
        )
