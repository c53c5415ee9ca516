"""Speculative decoding as a server setting (`--num-speculative-tokens`,
LORAPLEX_NUM_SPECULATIVE_TOKENS) and its acceptance counters on /metrics under vLLM's names,
scraped from a live server (engine in its own process) and read with prometheus_client's
parser after a request whose prompt repeats itself (an offline engine accepts proposals on
it): proposals were scored and accepted, and the counters agree with each other."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine import LLM, SamplingParams
from loraplex.platform import cli
from loraplex.platform.main import engine_config
from loraplex.platform.settings import Settings
from tests.utils.server import run_server

K = 4
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4 + "The quick brown"
MAX_TOKENS = 48
SERIES = ("drafts", "draft_tokens", "accepted_tokens")


def test_serve_flag_and_env_reach_the_engine_config(tiny_models, monkeypatch):
    model = str(tiny_models["llama"])
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--num-speculative-tokens", "3", "--max-model-len", "256"])
    assert engine_config(cli._settings(args), model).num_speculative_tokens == 3
    default = cli._settings(parser.parse_args(["serve", "--max-model-len", "256"]))
    assert engine_config(default, model).num_speculative_tokens == 0
    monkeypatch.setenv("LORAPLEX_NUM_SPECULATIVE_TOKENS", "5")
    assert Settings(max_model_len=256).num_speculative_tokens == 5
    monkeypatch.setenv("LORAPLEX_NUM_SPECULATIVE_TOKENS", "17")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Settings(max_model_len=256)


def _spec_counters(url: str) -> dict[str, object]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    out: dict[str, object] = {}
    for name in SERIES:
        fam = fams[f"vllm:spec_decode_num_{name}"]
        assert fam.type == "counter"
        (sample,) = [s for s in fam.samples if s.name.endswith("_total")]
        out[name] = sample.value
    per_pos = fams["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos.type == "counter"
    pos = {int(s.labels["position"]): s.value for s in per_pos.samples if s.name.endswith("_total")}
    out["per_pos"] = [pos[j] for j in sorted(pos)]
    return out


def test_acceptance_counters_on_metrics_from_a_live_server(tiny_models, tmp_path):
    model = tiny_models["llama"]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = LLM(str(model), dtype="float32", max_model_len=256, num_speculative_tokens=K)
    want_text = offline.generate([PROMPT], greedy)[0].outputs[0].text
    want = offline.engine.spec_stats
    assert want.num_accepted_tokens > 0  # the prompt repeats: some proposals land

    with run_server(model, tmp_path, num_speculative_tokens=K) as srv:
        assert srv.state.engine.config.num_speculative_tokens == K
        idle = _spec_counters(srv.url)
        assert idle == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": []}
        _, key = srv.new_tenant("spec")
        body = {"model": srv.state.model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{srv.url}/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"}, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want_text
        # The engine process sends a stats snapshot now and then: wait until two agree.
        # (Counts may differ from the offline engine's: the planner trims drafts by the step
        # times it measures.)
        deadline, last = time.monotonic() + 30, None
        while (got := _spec_counters(srv.url)) != last or not got["drafts"]:
            assert time.monotonic() < deadline, got
            last = got
            time.sleep(0.3)

    assert got["drafts"] > 0 and got["accepted_tokens"] > 0
    assert len(got["per_pos"]) <= K
    # A proposal is accepted only after every one before it: counts fall with the position.
    assert got["per_pos"] == sorted(got["per_pos"], reverse=True)
    assert sum(got["per_pos"]) == got["accepted_tokens"] <= got["draft_tokens"]
