"""The systems under test, all behind one small interface.

    engine = Ours(model_dir, adapters, max_loras, opts)   # or HFBaseline / peer.VLLMPeer
    result = engine.run(run_input)   # {"seconds", "output_tokens", "token_ids", ...}
    engine.close()

`seconds` is the wall time of one offline generate call with every prompt submitted at once.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workload import RunInput


@dataclass(frozen=True)
class EngineOptions:
    dtype: str = "bfloat16"
    max_lora_rank: int = 8
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 512
    max_tokens: int = 64
    hf_prompts: int = 32  # the naive baseline gets the first K prompts of each run
    peer_dtype: str | None = None  # vLLM's dtype (None: `dtype`)
    ours_extra: tuple[tuple[str, object], ...] = ()  # more EngineConfig options for ours


class Ours:
    name = "ours"

    def __init__(self, model_dir: Path, adapters: list[Path], max_loras: int, opts: EngineOptions):
        from loraplex.engine import LLM, LoRARequest, SamplingParams

        t = time.perf_counter()
        self.llm = LLM(
            model=str(model_dir),
            dtype=opts.dtype,
            max_loras=max_loras,
            max_lora_rank=opts.max_lora_rank,
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            max_model_len=opts.max_model_len,
            **dict(opts.ours_extra),
        )
        self.init_s = time.perf_counter() - t
        # What the engine actually computes in (it may upcast bf16 on CPUs without bf16 ops).
        self.compute_dtype = str(next(self.llm.engine.model.parameters()).dtype)
        self.loras = [LoRARequest(f"a{i:02d}", i + 1, str(p)) for i, p in enumerate(adapters)]
        self.params = SamplingParams(temperature=0.0, max_tokens=opts.max_tokens, ignore_eos=True)

    def run(self, inp: RunInput) -> dict:
        loras = [None if i is None else self.loras[i] for i in inp.adapters]
        gc.collect()
        t = time.perf_counter()
        outs = self.llm.generate(inp.prompts, self.params, lora_request=loras)
        seconds = time.perf_counter() - t
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        return {
            "seconds": seconds,
            "output_tokens": sum(map(len, token_ids)),
            "token_ids": token_ids,
        }

    def close(self) -> None:
        del self.llm
        gc.collect()


class HFBaseline:
    """transformers + peft, the way S-LoRA's "PEFT" baseline works: one adapter per batch.

    Prompts are grouped by adapter; each group is one left-padded `generate` call with that
    adapter active (the base-model group runs with adapters disabled). No paged KV cache, no
    continuous batching.
    """

    name = "hf"

    def __init__(self, model_dir: Path, adapters: list[Path], max_loras: int, opts: EngineOptions):
        import torch
        import transformers

        t = time.perf_counter()
        dtype = getattr(torch, opts.dtype)
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = base
        self.peft = None
        if adapters:
            from peft import PeftModel

            self.peft = PeftModel.from_pretrained(base, str(adapters[0]), adapter_name="a00")
            for i, path in enumerate(adapters[1:], start=1):
                self.peft.load_adapter(str(path), adapter_name=f"a{i:02d}")
            self.model = self.peft
        self.model.eval()
        self.opts = opts
        self.init_s = time.perf_counter() - t

    def run(self, inp: RunInput) -> dict:
        import contextlib

        import torch

        k = min(self.opts.hf_prompts, len(inp.prompts))
        groups: dict[int | None, list[int]] = {}
        for i in range(k):
            groups.setdefault(inp.adapters[i], []).append(i)
        token_ids: list[list[int]] = [[] for _ in range(k)]
        n = self.opts.max_tokens
        gc.collect()
        t = time.perf_counter()
        for adapter, rows in groups.items():
            if adapter is None:
                ctx = self.peft.disable_adapter() if self.peft else contextlib.nullcontext()
            else:
                self.peft.set_adapter(f"a{adapter:02d}")
                ctx = contextlib.nullcontext()
            width = max(len(inp.prompts[i]) for i in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)  # pad id 0, left padding
            mask = torch.zeros_like(ids)
            for j, i in enumerate(rows):
                p = inp.prompts[i]
                ids[j, width - len(p) :] = torch.tensor(p)
                mask[j, width - len(p) :] = 1
            with ctx, torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=0,
                )
            for j, i in enumerate(rows):
                token_ids[i] = out[j, width:].tolist()
        seconds = time.perf_counter() - t
        return {
            "seconds": seconds,
            "output_tokens": sum(map(len, token_ids)),
            "token_ids": token_ids,
            "num_prompts": k,
            "num_batches": len(groups),
        }

    def close(self) -> None:
        del self.model, self.peft
        gc.collect()
