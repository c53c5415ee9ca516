"""The kernel mode, an engine option held by each engine's backend, and the engine running end
to end on the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.kernels import cpu, dispatch, reference
from loraplex.kernels.backend import KernelBackend
from testkit.factories import make_adapter, make_tiny_model
from tests.kernels.conftest import DEVICE


def test_a_backend_picks_its_kernels_from_its_own_mode():
    cpu_t = torch.zeros(1)
    assert KernelBackend(mode="auto").which(cpu_t) == "cpu"
    assert KernelBackend(mode="triton").which(cpu_t) == "triton"
    assert KernelBackend(mode="reference").which(cpu_t) == "reference"
    assert dispatch.DEFAULT.mode == "auto"  # modules no engine bound, direct calls
    with pytest.raises(ValueError, match="auto, reference, triton"):
        KernelBackend(mode="cuda")
    assert not hasattr(dispatch, "set_mode") and not hasattr(dispatch, "_mode")


def test_two_engines_with_different_kernel_modes_do_not_affect_each_other(
    tiny_models, tiny_adapters, monkeypatch
):
    """A reference-mode engine and an auto-mode one alive in one process, stepped in turns:
    each runs only its own kernels (the reference's LoRA and attention, or the CPU backend's),
    whichever was built last, and the mode named in the environment (LORAPLEX_KERNELS, the
    option's default) reaches only engines built while it is set."""
    calls: list[str] = []
    for name, module in (("cpu", cpu), ("reference", reference)):
        for op in ("lora_apply", "paged_attention"):
            real = getattr(module, op)
            monkeypatch.setattr(module, op, lambda *a, _n=name, _f=real, **k: calls.append(_n)
                                or _f(*a, **k))  # fmt: skip
    model = str(tiny_models["llama"])
    adapter = LoRARequest("attn8", 1, str(tiny_adapters["llama"]["attn8"]))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ref = LLM(model, dtype="float32", max_lora_rank=8, kernel_mode="reference")
    monkeypatch.setenv("LORAPLEX_KERNELS", "reference")
    env_ref = LLM(model, dtype="float32", max_lora_rank=8)
    monkeypatch.delenv("LORAPLEX_KERNELS")
    auto = LLM(model, dtype="float32", max_lora_rank=8)
    assert (ref.engine.config.kernel_mode, env_ref.engine.config.kernel_mode) == ("reference",) * 2
    assert auto.engine.runner.backend.mode == "auto"
    outs = {}
    for name, llm in (("reference", ref), ("auto", auto), ("env", env_ref), ("auto2", auto)):
        calls.clear()
        outs[name] = llm.generate([[5, 9, 33, 70], [7, 8]], params, [adapter, None])
        want = "cpu" if name.startswith("auto") else "reference"
        assert calls and set(calls) == {want}, (name, set(calls))
    for name in ("auto", "env", "auto2"):  # the same tokens either way
        got = [o.outputs[0].token_ids for o in outs[name]]
        assert got == [o.outputs[0].token_ids for o in outs["reference"]], name


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_engine_generates_the_same_tokens_on_triton_kernels(tmp_path, kind):
    """Mixed batch (two adapters of different ranks + no adapter), prefill then decode.

    On CPU the Triton side runs under the interpreter; on CUDA it is the default `auto` mode.
    """
    base = make_tiny_model(kind, tmp_path / "base", seed=3)
    adapters = [
        make_adapter(base, tmp_path / "a4", r=4, targets=("q_proj", "v_proj"), seed=1),
        make_adapter(base, tmp_path / "a8", r=8, seed=2,
                     targets=("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ]  # fmt: skip
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    prompts = [[5 + i, 40, 77, 120 + i, 9, 300, 11 + 2 * i] for i in range(4)]
    lora = [requests[0], None, requests[1], requests[0]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)

    def run(mode: str):
        llm = LLM(str(base), dtype="float32", max_lora_rank=8, device=DEVICE.type,
                  kernel_mode=mode)  # fmt: skip
        outs = llm.generate(prompts, params, lora_request=lora)
        return [o.outputs[0] for o in outs]

    expected = run("reference")
    got = run("auto" if DEVICE.type == "cuda" else "triton")
    for e, g in zip(expected, got, strict=True):
        assert g.token_ids == e.token_ids
        # Same distribution, not just the same argmax.
        e_lp = [lp[t] for lp, t in zip(e.logprobs, e.token_ids, strict=True)]
        g_lp = [lp[t] for lp, t in zip(g.logprobs, g.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(e_lp), atol=1e-3, rtol=1e-3)
