"""Prefill and decode on different engines (engine/disagg): a prefill engine and a decode
engine sharing one KV tier give, request for request, the outputs of one colocated engine.

Two LLMEngines in this process, each with its own device pool, share only a disk tier (a
folder): the decode engine can see the prefill engine's work only through the store. Runs are
float32 on the tiny llama with mixed adapters; each case checks every sample's tokens, text,
finish and stop reasons, logprobs and prompt logprobs against the colocated engine, and that
the decode engine loaded the prompts' full blocks rather than computing them.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.disagg import DecodeWorker, Handoff, PrefillWorker, run_disaggregated
from loraplex.engine.sampling.structured_output import grammar_spec

BS = 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _llm(model, **kw) -> LLM:
    base = dict(dtype="float32", block_size=BS, max_model_len=256, max_lora_rank=16)
    return LLM(str(model), **{**base, **kw})


REDIS = "redis://127.0.0.1:6379/0"


def _redis_up() -> bool:
    try:
        import redis

        redis.Redis.from_url(REDIS, socket_timeout=1).ping()
    except Exception:  # noqa: BLE001 (no client or no server: that tier is left out, saying so)
        return False
    return True


@pytest.fixture(scope="module", params=["disk", "redis"])
def engines(request, tiny_models, tmp_path_factory):
    """(colocated, prefill worker, decode worker) on the tiny llama, the workers sharing a
    disk folder (one host) or Redis (between hosts; each run salted apart)."""
    model = tiny_models["llama"]
    if request.param == "disk":
        tier = dict(kv_tier_disk_path=str(tmp_path_factory.mktemp("kv-tier")))
    elif _redis_up():
        tier = dict(kv_tier_shared_url=REDIS, kv_tier_salt=uuid.uuid4().hex, kv_tier_ttl_s=600)
    else:
        pytest.skip(f"no Redis at {REDIS}: the shared tier's case is left out")
    colocated = _llm(model)
    prefill = PrefillWorker(_llm(model, **tier).engine)
    decode = DecodeWorker(_llm(model, **tier).engine)
    yield colocated, prefill, decode
    for w in (prefill, decode):
        w.engine.adapters.close()
        w.engine.close()
    colocated.engine.adapters.close()


@pytest.fixture(scope="module")
def loras(tiny_adapters) -> list[LoRARequest | None]:
    named = tiny_adapters["llama"]
    return [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(named.items())]


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _colocated(llm: LLM, requests) -> dict:
    engine = llm.engine
    for rid, prompt, params, lora in requests:
        engine.add_request(rid, prompt, params, lora)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _same(a, b) -> None:
    assert a.prompt == b.prompt and a.prompt_token_ids == b.prompt_token_ids
    assert a.error == b.error
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x.token_ids == y.token_ids, a.request_id
        assert x.text == y.text
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert [list(e) for e in x.logprobs] == [list(e) for e in y.logprobs]
            for ex, ey in zip(x.logprobs, y.logprobs, strict=True):
                for t in ex:
                    assert ex[t] == pytest.approx(ey[t], abs=1e-4)
    assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
    if a.prompt_logprobs is not None:
        assert a.prompt_logprobs.ranks == b.prompt_logprobs.ranks
        assert a.prompt_logprobs.top == b.prompt_logprobs.top
    assert a.num_generated_tokens == b.num_generated_tokens


def _requests(loras, tag: str) -> list[tuple]:
    """Mixed adapters and every feature the handoff must carry."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    greedy = dict(temperature=0, max_tokens=10)
    cases = [
        SamplingParams(**greedy, ignore_eos=True),
        SamplingParams(**greedy, logprobs=3, ignore_eos=True),
        SamplingParams(**greedy, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, n=2, best_of=3, max_tokens=6, ignore_eos=True),
        SamplingParams(**greedy, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=4),
        SamplingParams(
            temperature=0, max_tokens=40, logits_processors=[grammar_spec("json_schema", schema)]
        ),  # fmt: skip
        SamplingParams(temperature=0, max_tokens=1),  # ends at the prefill worker
        SamplingParams(temperature=0, max_tokens=None, stop_token_ids=list(range(5, 500, 3))),
    ]
    out = []
    for i, params in enumerate(cases):
        n = [5, BS * 3, BS * 4 + 3, 21, 40, 17, 9, 33, 26][i]
        out.append((f"{tag}-{i}", _prompt(i, n), params, loras[i % len(loras)]))
    return out


def test_outputs_identical_to_one_colocated_engine(engines, loras):
    colocated, prefill, decode = engines
    requests = _requests(loras, "mix")
    want = _colocated(colocated, requests)
    loaded0 = decode.engine.kv_tiers.tokens_loaded
    got = run_disaggregated(prefill, decode, requests)
    assert set(got) == set(want)
    for rid in want:
        _same(got[rid], want[rid])
    assert prefill.answered >= 1  # max_tokens=1 ends at the prefill worker
    # Every full prompt block the decode worker needed came from the tier, not the model
    # (the prompt_logprobs request's blocks too: the decode side does not score the prompt).
    handed = [r for r in requests if r[2].max_tokens != 1]
    expected = sum(len(p) // BS * BS for _, p, _, _ in handed)
    assert decode.engine.kv_tiers.tokens_loaded - loaded0 >= expected
    for w in (prefill, decode):
        w.engine.block_manager.check_all_free()


def test_stop_string_held_back_across_the_handoff(engines, loras):
    """A stop string that spans the first token and later ones: the text the decode worker
    streams never shows what one engine would have held back."""
    colocated, prefill, decode = engines
    prompt = _prompt(50, 19)
    probe = colocated.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True), loras[1])[0]  # fmt: skip
    text = probe.outputs[0].text
    assert len(text) >= 4, text
    stop = text[1:4]  # begins inside the first token's text or just after
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])
    requests = [("stop-0", prompt, params, loras[1])]
    want = _colocated(colocated, requests)["stop-0"]
    prefill.add_request("stop-s", prompt, params, loras[1])
    streamed = ""
    while prefill.has_unfinished() or decode.has_unfinished():
        for item in prefill.step():
            assert isinstance(item, Handoff)
            first = decode.add_handoff(Handoff.from_json(item.to_json()))  # as between processes
            streamed += first.delta_text
        for out in decode.step() if decode.has_unfinished() else []:
            streamed += out.delta_text
            last = out
    assert last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert streamed == last.outputs[0].text == want.outputs[0].text


def test_aborts_free_both_sides(engines, loras):
    _, prefill, decode = engines
    # Aborted on the prefill worker before its handoff.
    prefill.add_request("ab-0", _prompt(60, 30), SamplingParams(temperature=0, max_tokens=5),
                        loras[2])  # fmt: skip
    prefill.abort("ab-0")
    assert prefill.step() == []
    prefill.engine.block_manager.check_all_free()
    # Aborted on the decode worker after its first step there.
    prefill.add_request("ab-1", _prompt(61, 30), SamplingParams(temperature=0, max_tokens=50,
                        ignore_eos=True), loras[2])  # fmt: skip
    handoffs = []
    while not handoffs:
        handoffs = [h for h in prefill.step() if isinstance(h, Handoff)]
    decode.add_handoff(handoffs[0])
    decode.step()
    decode.step()
    out = decode.abort("ab-1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    decode.engine.block_manager.check_all_free()
    assert not decode.has_unfinished()
