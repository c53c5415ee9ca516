"""The start log's memory line: the base's resident weight bytes and format, the KV tokens and
the adapters that fit, as the engine really sized them (KV tensors, slot tensors)."""

from __future__ import annotations

import logging

import pytest

from loraplex.engine import LLM
from loraplex.engine.weights.quantization import resident_weight_bytes
from testkit.factories import make_tiny_model
from tests.engine.test_quant_checkpoints import WIDE
from tests.utils.quant_checkpoints import write_quantized

BUDGET = 2 << 20


def _start(folder, caplog, **kw) -> tuple[LLM, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loraplex.engine"):
        llm = LLM(str(folder), dtype="float32", max_loras=3, max_cpu_loras=7, max_lora_rank=8,
                  kv_cache_bytes=BUDGET, **kw)  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: ")]
    assert len(lines) == 1, "one memory line at start"
    return llm, lines[0]


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("mem") / "llama", seed=3, **WIDE)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_start_line_reports_weights_kv_tokens_and_adapter_slots(wide_llama, caplog, quantization):
    llm, line = _start(wide_llama, caplog, quantization=quantization)
    engine = llm.engine
    weights = resident_weight_bytes(engine.model)
    assert line.startswith("memory: on cpu: weights ")  # where the engine runs
    assert (
        f"weights {weights / 2**20:.1f} MiB (float32, quantization={quantization or 'none'})"
        in line
    )
    # The tokens the line names are the tokens the allocated cache holds.
    k_cache = engine.model.model.layers[0].self_attn.k_cache  # [blocks, block_size, heads, dim]
    tokens = k_cache.shape[0] * k_cache.shape[1]
    assert f"KV cache {tokens} tokens ({k_cache.shape[0]} blocks of {k_cache.shape[1]}" in line
    assert engine.memory.kv_cache_tokens == tokens == engine.block_manager.num_blocks * 16
    # Three device slots of rank <= 8, seven adapters in host memory; the slots' tensors are
    # what the line's MiB counts, out of the same budget as the KV pool.
    slot_bytes = sum(
        m.lora_a.nbytes + m.lora_b.nbytes for mods in engine.adapters.modules for m in mods.values()
    )
    assert f"adapter slots 3 of rank <= 8 ({slot_bytes / 2**20:.1f} MiB) + 7 in host memory" in line
    assert engine.memory.kv_cache_bytes + slot_bytes <= BUDGET
    assert engine.adapters.slots == [None] * 3 and engine.adapters.max_cpu_loras == 7


def test_quantized_formats_report_fewer_weight_bytes_and_the_same_kv(wide_llama, caplog):
    reports = {q: _start(wide_llama, caplog, quantization=q)[0].engine.memory
               for q in (None, "int8", "int4")}  # fmt: skip
    assert reports["int4"].weight_bytes < reports["int8"].weight_bytes < reports[None].weight_bytes
    # The KV budget is its own: the weights' format does not change the tokens it holds.
    assert len({r.kv_cache_tokens for r in reports.values()}) == 1


def test_a_gptq_folder_is_named_by_its_checkpoint_format(wide_llama, tmp_path, caplog):
    folder = write_quantized(wide_llama, tmp_path / "gptq", "gptq")
    llm, line = _start(folder, caplog)
    assert "quantization=gptq)" in line
    assert llm.engine.memory.quantization == "gptq"


def test_the_gpu_pool_is_the_share_left_after_weights_and_working_memory():
    """gpu_memory_utilization's arithmetic (what a GPU engine gives its KV pool)."""
    from loraplex.engine.memory.budget import gpu_pool_bytes, step_working_bytes

    gib = 1 << 30
    # 0.9 of 80 GiB, less 16 held (weights, slots) and 2 of working memory
    assert gpu_pool_bytes(80 * gib, 79 * gib, 16 * gib, 0.9, 2 * gib) == 54 * gib
    # another process holds most of the device: no more than is free, less working memory
    assert gpu_pool_bytes(80 * gib, 30 * gib, 16 * gib, 0.9, 2 * gib) == 28 * gib
    assert gpu_pool_bytes(80 * gib, 79 * gib, 16 * gib, 0.2, 2 * gib) == 0  # nothing left
    working = step_working_bytes(4096, 6144, 14336, 128256, 2, 2048, 64)
    assert gib < working < 2 * gib  # an 8B at 2,048 batched tokens: ~1.5 GiB, 1 of it fixed


def test_gpu_memory_utilization_changes_nothing_on_the_cpu(wide_llama, caplog):
    _, plain = _start(wide_llama, caplog)
    _, share = _start(wide_llama, caplog, gpu_memory_utilization=0.5)
    assert share == plain  # the CPU's pool is kv_cache_bytes either way
