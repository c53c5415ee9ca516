"""The one backend switch, and the engine running end to end on the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.kernels import dispatch
from testkit.factories import make_adapter, make_tiny_model
from tests.kernels.conftest import DEVICE


@pytest.fixture
def restore_mode():
    mode = dispatch.get_mode()
    yield
    dispatch.set_mode(mode)


def test_mode_switch(restore_mode):
    cpu = torch.zeros(1)
    dispatch.set_mode("auto")
    assert not dispatch.use_triton(cpu)
    dispatch.set_mode("triton")
    assert dispatch.use_triton(cpu)
    dispatch.set_mode("reference")
    assert not dispatch.use_triton(cpu)
    with pytest.raises(ValueError, match="auto, reference, triton"):
        dispatch.set_mode("cuda")


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_engine_generates_the_same_tokens_on_triton_kernels(tmp_path, restore_mode, kind):
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
        dispatch.set_mode(mode)
        llm = LLM(str(base), dtype="float32", max_lora_rank=8, device=DEVICE.type)
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
