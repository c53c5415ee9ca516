"""LoRA on a quantized base: the demo adapters, trained on the float base, served over each
weight format of `benchmarks.quant`.

Each adapter is run teacher-forced over its own task (the demo questions in the chat format it
was trained on, its answers as targets). Per format and adapter: greedy agreement (argmax at
every answer position equal to float base + the same adapter) and the answers' perplexity
ratio to float base + adapter. On the float row the adapter is also compared with no adapter
at all: how many answer tokens the adapter changes, the scale the agreement reads against.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.engine import LLM, LoRARequest
from loraplex.engine.forward_context import AttentionMetadata, ForwardContext, LoRABatch


@torch.inference_mode()
def forward_logits(llm: LLM, ids: list[int], slot: int | None = None) -> torch.Tensor:
    """Logits of one sequence in one prefill, all rows on adapter `slot` (None: the base)."""
    model, n = llm.engine.model, len(ids)
    blocks = -(-n // llm.engine.config.block_size)
    attn = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=torch.arange(blocks).unsqueeze(0),
    )  # fmt: skip
    lora = None if slot is None else LoRABatch([(0, n, slot)])
    hidden = model(torch.tensor(ids), torch.arange(n), ForwardContext(attn=attn, lora=lora))
    return model.compute_logits(hidden).float()  # [n, vocab]


def task_sequences(llm: LLM, name: str) -> list[tuple[list[int], int]]:
    """(token ids, first answer position) of adapter `name`'s training examples."""
    from loraplex.platform.demo.adapters import RECIPES, _examples  # the training format
    from loraplex.platform.demo.data import EXAMPLES

    pairs = [(q, RECIPES[name](plain, pirate)) for q, plain, pirate in EXAMPLES]
    return _examples(llm.get_tokenizer(), pairs)


def load_into_slot(llm: LLM, name: str, folder: Path, lora_id: int) -> tuple[int, int]:
    """Read the PEFT folder through the engine's adapter manager and write it into a device
    slot, as a request would; returns (slot, the adapter's bytes in host memory)."""
    manager = llm.engine.adapters
    manager.acquire(LoRARequest(name, lora_id, str(folder)))
    manager.wait(lora_id)
    failed = manager.poll()
    if lora_id in failed:
        raise failed[lora_id]
    return manager.activate({lora_id})[lora_id], manager.host[lora_id].nbytes


def answer_argmax(
    llm: LLM, seqs: list[tuple[list[int], int]], slot: int | None
) -> tuple[float, torch.Tensor]:
    """Perplexity of the answer tokens and the argmax at each answer position."""
    nll, n, argmax = 0.0, 0, []
    for ids, start in seqs:
        logits = forward_logits(llm, ids, slot)[start - 1 : -1]  # rows predicting the answer
        target = torch.tensor(ids[start:])
        nll += F.cross_entropy(logits, target, reduction="sum").item()
        n, argmax = n + len(target), [*argmax, logits.argmax(-1)]
    return math.exp(nll / n), torch.cat(argmax)


def measure_adapters(
    llm: LLM, adapters: dict[str, Path], reference: dict[str, tuple[float, torch.Tensor]] | None
) -> tuple[dict[str, dict], dict[str, tuple[float, torch.Tensor]]]:
    """Per adapter: its figures on this base, and (perplexity, argmax) for later rows to
    compare against (this base's own when `reference` is None: the float row)."""
    rows, own = {}, {}
    for i, (name, folder) in enumerate(sorted(adapters.items()), start=1):
        slot, nbytes = load_into_slot(llm, name, folder, lora_id=i)
        seqs = task_sequences(llm, name)
        ppl, argmax = answer_argmax(llm, seqs, slot)
        own[name] = (ppl, argmax)
        ref_ppl, ref_argmax = (reference or own)[name]
        row = {
            "answer_perplexity": ppl, "ratio": ppl / ref_ppl,
            "greedy_agreement": (argmax == ref_argmax).float().mean().item(),
            "answer_tokens": len(argmax), "adapter_bytes": nbytes,
        }  # fmt: skip
        if reference is None:  # how much the adapter changes the float base's answers
            _, plain = answer_argmax(llm, seqs, None)
            row["agreement_without_adapter"] = (plain == argmax).float().mean().item()
        rows[name] = row
    return rows, own
