"""/metrics reports the memory the engine sized at start: resident weight bytes by format, the
KV tokens and the adapters that fit (a live server, engine in its own process)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.llm_engine import LLMEngine
from loraplex.platform.main import engine_config
from tests.utils.server import run_server


def test_metrics_report_weight_bytes_kv_capacity_and_adapter_slots(tiny_models, tmp_path):
    model = tiny_models["llama"]
    with run_server(model, tmp_path, quantization="int8", max_loras=2, max_cpu_loras=5) as srv:
        assert srv.settings.engine_process  # the report crosses the process pipe
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        settings = srv.settings
    fams = {f.name: f.samples for f in text_string_to_metric_families(text)}
    # The same settings, sized again here: the figures are the engine's own, not defaults.
    engine = LLMEngine(engine_config(settings, str(model)))
    want = engine.memory
    (weights,) = fams["loraplex_model_weight_bytes"]
    assert weights.labels == {"quantization": "int8"}
    assert weights.value == want.weight_bytes > 0
    float_engine = LLMEngine(engine_config(settings.model_copy(update={"quantization": None}),
                                           str(model)))  # fmt: skip
    assert want.weight_bytes < float_engine.memory.weight_bytes
    (tokens,) = fams["loraplex_kv_cache_capacity_tokens"]
    assert tokens.value == want.num_kv_blocks * want.block_size > 0
    assert fams["loraplex_kv_cache_bytes"][0].value == want.kv_cache_bytes
    slots = {s.labels["tier"]: s.value for s in fams["loraplex_adapter_slots"]}
    assert slots == {"device": 2, "host": 5}
    (device,) = fams["loraplex_engine_device_info"]  # the server's device auto, no GPU here
    assert device.labels == {"device": "cpu"} and device.value == 1
