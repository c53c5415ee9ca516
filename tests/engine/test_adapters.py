"""Adapters through the engine: bad ones are refused with a clear message and load nothing;
PEFT's rank/alpha patterns and rsLoRA scale like peft; host-cache pins are released."""

from __future__ import annotations

import builtins
import io
import pickle
from pathlib import Path

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.adapters.lora import AdapterError
from testkit.factories import BAD_ADAPTER_KINDS, HUGE_RANK, make_adapter, make_bad_adapters

MAX_RANK = 16
PROMPT = [1, 17, 42, 99, 250, 7]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

# What the message must say for each broken adapter.
BAD_MESSAGES = {
    "pickle_only": r"pickle.*never unpickles",
    "wrong_shape": r"do not fit the base model",
    "unknown_target": r"'foo_proj' is not supported",
    "nan": r"NaN or Inf",
    "inf": r"NaN or Inf",
    "missing_config": r"adapter_config\.json is missing",
    "missing_weights": r"adapter_model\.safetensors is missing",
    "truncated": r"unreadable safetensors",
    "bad_json": r"not valid JSON",
    "huge_rank": rf"rank {HUGE_RANK} exceeds max_lora_rank {MAX_RANK}",
    "config_unknown_target": r"'not_a_module' does not exist in the base model",
    "undeclared_weights": r"which adapter_config\.json's target_modules .* does not declare",
    "regex_targets": r"regular expression, which is not supported",
}


@pytest.fixture(scope="module")
def llama(tiny_models) -> str:
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def good(tiny_models, tmp_path_factory) -> Path:
    return make_adapter(tiny_models["llama"], tmp_path_factory.mktemp("good") / "qv8", r=8, seed=5)


@pytest.fixture(scope="module")
def bad(good, tmp_path_factory) -> dict[str, Path]:
    return make_bad_adapters(good, tmp_path_factory.mktemp("bad"))


@pytest.fixture(scope="module")
def good_tokens(llama, good) -> list[int]:
    llm = LLM(llama, dtype="float32", max_lora_rank=MAX_RANK)
    out = llm.generate([PROMPT], GREEDY, LoRARequest("good", 1, str(good)))
    base = llm.generate([PROMPT], GREEDY)
    assert out[0].outputs[0].token_ids != base[0].outputs[0].token_ids, "adapter must matter"
    return out[0].outputs[0].token_ids


def drain(engine) -> dict[str, list[int]]:
    done = {}
    for _ in range(200):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    raise AssertionError("engine did not finish")


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any attempt to unpickle, or to open a pickle file, fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("an adapter file was unpickled")

    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if str(file).endswith((".bin", ".pt", ".pth")):
            raise AssertionError(f"{file} was opened")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)


# ---------------------------------------------------------------------------- bad adapters
def test_every_bad_kind_has_an_expected_message():
    assert set(BAD_MESSAGES) == set(BAD_ADAPTER_KINDS)


@pytest.mark.parametrize("kind", BAD_ADAPTER_KINDS)
def test_bad_adapter_is_refused_and_loads_nothing(
    kind, llama, good, bad, good_tokens, no_unpickling
):
    engine = LLM(llama, dtype="float32", max_lora_rank=MAX_RANK).engine
    engine.add_request("in-flight", PROMPT, GREEDY, LoRARequest("good", 1, str(good)))
    with pytest.raises(AdapterError, match=BAD_MESSAGES[kind]) as err:
        engine.add_request("bad", PROMPT, GREEDY, LoRARequest(kind, 2, str(bad[kind])))
    assert isinstance(err.value, ValueError)  # the server maps ValueError to a 4xx
    assert list(engine.requests) == ["in-flight"]
    assert 2 not in engine.adapters.host and engine.adapters.refs == {1: 1}
    assert engine.adapters.loads == 1
    # The engine is unharmed: the queued request and a new one both complete correctly.
    engine.add_request("after", PROMPT, GREEDY, LoRARequest("good", 1, str(good)))
    assert drain(engine) == {"in-flight": good_tokens, "after": good_tokens}
    assert not engine.has_unfinished() and engine.adapters.refs == {}
    engine.block_manager.check_all_free()


def test_bad_adapter_alone_leaves_engine_empty(llama, bad):
    engine = LLM(llama, dtype="float32", max_lora_rank=MAX_RANK).engine
    with pytest.raises(AdapterError):
        engine.add_request("bad", PROMPT, GREEDY, LoRARequest("nan", 3, str(bad["nan"])))
    assert not engine.has_unfinished()
    assert engine.requests == {} and not engine.adapters.host and engine.adapters.refs == {}


def test_missing_folder_is_refused(llama, tmp_path):
    engine = LLM(llama, dtype="float32").engine
    with pytest.raises(AdapterError, match="does not exist"):
        engine.add_request("x", PROMPT, GREEDY, LoRARequest("gone", 1, str(tmp_path / "gone")))
    assert not engine.has_unfinished()


def test_bad_adapter_in_a_batch_queues_nothing(llama, good, bad, good_tokens):
    llm = LLM(llama, dtype="float32", max_lora_rank=MAX_RANK)
    loras = [LoRARequest("good", 1, str(good)), LoRARequest("trunc", 2, str(bad["truncated"]))]
    with pytest.raises(AdapterError, match="unreadable safetensors"):
        llm.generate([PROMPT, PROMPT], GREEDY, loras)
    engine = llm.engine
    assert not engine.has_unfinished() and engine.requests == {}
    assert engine.adapters.refs == {} and 2 not in engine.adapters.host
    engine.block_manager.check_all_free()
    out = llm.generate([PROMPT], GREEDY, loras[0])
    assert out[0].outputs[0].token_ids == good_tokens


def test_adapter_for_another_base_model_is_refused(tiny_models, tmp_path, llama):
    # gemma3's tiny model has head_dim 32: its q_proj is [128, 64], llama's is [64, 64].
    other = make_adapter(tiny_models["gemma3"], tmp_path / "gemma_qv", r=4)
    engine = LLM(llama, dtype="float32").engine
    with pytest.raises(AdapterError, match=r"wrong base model"):
        engine.add_request("x", PROMPT, GREEDY, LoRARequest("gemma", 1, str(other)))
    assert not engine.has_unfinished() and not engine.adapters.host


# ---------------------------------------------------------------------------- scaling vs peft
def _peft_adapter(base: str, out_dir: Path, seed: int = 0, **lora_kwargs) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **lora_kwargs)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _peft_greedy(base: str, adapter: Path, prompt: list[int], steps: int):
    """Greedy tokens and each step's log-softmax from transformers + peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
    ).eval()
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], dim=-1)
        logprobs.append(lp)
        ids.append(int(lp.argmax()))
    return ids[len(prompt) :], logprobs


def _assert_matches_peft(llama: str, adapter: Path) -> None:
    steps = 5
    tokens, ref = _peft_greedy(llama, adapter, PROMPT, steps)
    llm = LLM(llama, dtype="float32", max_lora_rank=MAX_RANK)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=5)
    out = llm.generate([PROMPT], params, LoRARequest("pat", 1, str(adapter)))[0].outputs[0]
    assert out.token_ids == tokens
    for step, (entry, lp) in enumerate(zip(out.logprobs, ref, strict=True)):
        got = torch.tensor([entry[t] for t in sorted(entry)])
        want = lp[sorted(entry)]
        torch.testing.assert_close(
            got, want, rtol=1e-4, atol=1e-4, msg=lambda m, step=step: f"step {step}: {m}"
        )


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("use_rslora", [False, True])
def test_rank_and_alpha_patterns_match_peft(llama, tmp_path, use_rslora):
    adapter = _peft_adapter(
        llama,
        tmp_path / "patterns",
        r=4,
        lora_alpha=8,
        target_modules=ALL_TARGETS,
        rank_pattern={"v_proj": 8, "down_proj": 2},
        alpha_pattern={"q_proj": 32, "up_proj": 3},
        use_rslora=use_rslora,
    )
    _assert_matches_peft(llama, adapter)


def test_per_layer_rank_pattern_matches_peft(llama, tmp_path):
    adapter = _peft_adapter(
        llama,
        tmp_path / "layer_rank",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"model.layers.1.self_attn.v_proj": 8},
    )
    _assert_matches_peft(llama, adapter)


def test_per_layer_alpha_pattern_matches_peft(llama, tmp_path):
    adapter = _peft_adapter(
        llama,
        tmp_path / "layer_alpha",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        alpha_pattern={"layers.0.self_attn.q_proj": 64},
    )
    _assert_matches_peft(llama, adapter)


# ---------------------------------------------------------------------------- ref counting
def test_adapter_refs_follow_requests_and_are_released(llama, good, tiny_models, tmp_path):
    other = make_adapter(tiny_models["llama"], tmp_path / "other", r=4, seed=9)
    engine = LLM(llama, dtype="float32", max_lora_rank=MAX_RANK).engine
    a, b = LoRARequest("good", 1, str(good)), LoRARequest("other", 2, str(other))
    engine.add_request("a1", PROMPT, GREEDY, a)
    engine.add_request("a2", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), a)
    engine.add_request("b1", PROMPT, GREEDY, b)
    engine.add_request("base", PROMPT, GREEDY)
    assert engine.adapters.refs == {1: 2, 2: 1}
    assert engine.adapters.loads == 2, "a second request for a loaded adapter reuses it"
    engine.abort("b1")
    assert engine.adapters.refs == {1: 2}
    for _ in range(GREEDY.max_tokens):  # one token per step: a1 is done, a2 still runs
        engine.step()
    assert "a1" not in engine.requests and "a2" in engine.requests
    assert engine.adapters.refs == {1: 1}
    drain(engine)
    assert engine.adapters.refs == {} and engine.requests == {}


def test_host_cache_keeps_at_most_max_cpu_loras_when_idle(llama, tiny_models, tmp_path):
    llm = LLM(llama, dtype="float32", max_lora_rank=MAX_RANK, max_loras=1, max_cpu_loras=2)
    paths = [
        make_adapter(tiny_models["llama"], tmp_path / f"a{i}", r=2, seed=20 + i) for i in range(4)
    ]
    for i, path in enumerate(paths):
        llm.generate([PROMPT], GREEDY, LoRARequest(f"a{i}", i + 1, str(path)))
        assert len(llm.engine.adapters.host) <= 2
    assert list(llm.engine.adapters.host) == [3, 4], "least recently used adapters go first"
    assert llm.engine.adapters.refs == {}


def test_names_the_adapter_in_the_output(llama, good):
    llm = LLM(llama, dtype="float32", max_lora_rank=MAX_RANK)
    out = llm.generate([PROMPT, PROMPT], GREEDY, [LoRARequest("good", 1, str(good)), None])
    assert [o.lora_name for o in out] == ["good", None]
