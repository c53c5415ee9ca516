"""The tensor-parallel messages' codec (engine/parallel/codec.py): real step plans, taken from
a one-device engine's steps (prefills, LoRA segments with their CPU plans, RoPE tables, a
graph-ready decode step's DecodeInputs, a loaded adapter), come back equal field by field and
tensor by tensor, and the decoded plan drives the model to the same logits; bytes that are not
a message (garbage, a pickle, a class it does not carry, a tensor past the end) are refused
with a ValueError, and a value it does not carry is refused when encoding."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.parallel import codec

ARGS = dict(dtype="float32", max_loras=2, max_lora_rank=16, block_size=8, max_num_seqs=4,
            max_model_len=64, num_kv_blocks=16)  # fmt: skip


def _same(a, b, where="message"):
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def steps(tiny_models, tiny_adapters):
    """Every step message a TP rank 0 would send on this one-device engine's run, encoded,
    decoded and compared before the step runs (the runner's host lists change after it), and
    for one eager step with LoRA, the model's output on the decoded plan and on the original;
    and the adapters the slots hold."""
    llm = LLM(str(tiny_models["llama"]), enforce_eager=False, **ARGS)
    runner, model, seen, outs = llm.engine.runner, llm.engine.model, [], []
    forward = runner.forward

    def keep(batch):
        step = batch.decode if batch.decode is not None else (
            batch.input_ids, batch.positions, batch.ctx)  # fmt: skip
        message = ("step", [("copy", [(1, 2)])], step)
        _same(codec.decode(codec.encode(message)), message, f"step {len(seen)}")
        seen.append(step)
        if not outs and isinstance(step, tuple) and step[2].lora is not None:
            _, _, (ids, pos, ctx) = codec.decode(codec.encode(message))
            outs.append((model(ids, pos, ctx), model(*step)))  # the same KV written twice
        return forward(batch)

    runner.forward = keep
    loras = [
        LoRARequest(n, i + 1, str(f)) for i, (n, f) in enumerate(tiny_adapters["llama"].items())
    ]
    prompts = [[5, 17, 300, 41, 9, 77, 12], [6, 18], [7, 19, 301, 42, 10], [8, 20, 302]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, params, [loras[0], loras[1], None, loras[0]])
    adapters = list(llm.engine.adapters.host.values())
    yield seen, outs, adapters
    llm.engine.close()


def test_real_plans_round_trip(steps):
    seen, _, adapters = steps
    # prefills (eager plans, LoRA segments with their CPU plans) and graph-ready decodes
    assert {type(s).__name__ for s in seen} == {"tuple", "DecodeInputs"}
    assert any(isinstance(s, tuple) and s[2].lora is not None and s[2].lora.plans for s in seen)
    assert adapters
    message = ("slot", 1, adapters[0])
    _same(codec.decode(codec.encode(message)), message)
    _same(codec.decode(codec.encode(("init", 9, "sdpa"))), ("init", 9, "sdpa"))


def test_a_decoded_plan_drives_the_model_alike(steps):
    _, outs, _ = steps
    assert outs
    decoded, original = outs[0]
    assert torch.equal(decoded, original)


def test_what_is_not_a_message_is_refused():
    good = codec.encode(("step", [], (torch.arange(3), [1.5, None], {"k": frozenset({2})})))
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + n])

    def blob(h, body=b""):
        raw = json.dumps(h).encode()
        return len(raw).to_bytes(8, "little") + raw + body

    bad = {
        "garbage": b"\x00\xff" * 20,
        "short": b"\x01",
        "a pickle": pickle.dumps(("step", [], None)),
        "header past the end": (10**9).to_bytes(8, "little") + b"{}",
        "not JSON": (3).to_bytes(8, "little") + b"{{{",
        "a class it does not carry": blob(["C", "Popen", {"args": "sh"}]),
        "wrong fields": blob(["C", "DecodeInputs", {"input_ids": ["l", []]}]),
        "unknown tag": blob(["eval", "1"]),
        "a bare list": blob([1, 2]),
        "a tensor past the end": blob(["T", "float32", [4], "cpu", 0], b"\x00" * 8),
        "a bad dtype": blob(["T", "object", [1], "cpu", 0], b"\x00" * 8),
        "a negative shape": blob(["T", "int64", [-1], "cpu", 0]),
    }
    for what, data in bad.items():
        with pytest.raises(ValueError, match="not a tensor-parallel message"):
            codec.decode(data)
        assert what
    _same(codec.decode(blob(header, good[8 + n :])), codec.decode(good))
    with pytest.raises(TypeError, match="cannot carry"):
        codec.encode(("step", [], object()))
    with pytest.raises(TypeError, match="cannot carry"):
        codec.encode(("step", [], torch.zeros(2, dtype=torch.complex64)))
