"""Turns a scheduler step into tensors, runs the model and samples.

Rows are ordered by adapter slot so each adapter's rows form one contiguous segment (the
shape the SGMV ops want); rows without an adapter form segments with slot -1. Only the last
row of each sequence that completes its tokens this step goes through the LM head, and the
prompt rows of requests that ask for prompt logprobs (engine/sampling/prompt_logprobs.py).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass

import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.forward_context import ForwardContext
from loraplex.engine.memory import kv_cache
from loraplex.engine.models.decoder import DecoderLM
from loraplex.engine.sampling.prompt_logprobs import PromptRows, score_prompt_rows
from loraplex.engine.sampling.sampler import LOGPROB_FLOOR, Sampler, make_generator
from loraplex.engine.scheduling.scheduler import SchedulerOutput
from loraplex.engine.sequence import Sequence
from loraplex.engine.step.graph_runner import DecodeGraphs, DecodeInputs
from loraplex.engine.step.step_plan import StepPlanner
from loraplex.kernels import backend as kernel_backend
from loraplex.kernels import cpu as cpu_kernels

log = logging.getLogger("loraplex.engine")


@dataclass
class StepBatch:
    input_ids: torch.Tensor | None  # [num_tokens] (None: a graph-ready decode step)
    positions: torch.Tensor | None  # [num_tokens]
    ctx: ForwardContext | None  # None: a graph-ready decode step, `decode` holds its inputs
    sample_rows: list[int]  # row of each sampling sequence's last token
    sample_seqs: list[Sequence]
    seqs: list[Sequence]  # all sequences, in row order
    prompt_rows: PromptRows  # rows that score prompt tokens (SamplingParams.prompt_logprobs)
    decode: DecodeInputs | None = None  # a graph-ready decode step (engine/step/graph_runner.py)


def kv_block_bytes(model: DecoderLM, block_size: int, kv_cache_dtype: str = "auto") -> int:
    return kv_cache.kv_block_bytes(model.spec, block_size, model.dtype, kv_cache_dtype)


def choose_cpu_attention(config: EngineConfig, model: DecoderLM | None) -> str:
    """The CPU attention form for one engine (config.cpu_attention; "auto" times both on a
    decode batch of the model's shape). Engines that must compute alike name the form: two
    forms round differently."""
    impl = config.cpu_attention
    if impl == "auto":
        s = model.spec
        times = cpu_kernels.pick_attention_impl(
            s.num_heads, s.num_kv_heads, s.head_dim, model.dtype,
            batch=min(config.max_num_seqs, 32), context=min(config.max_model_len, 256),
        )  # fmt: skip
        impl = next(iter(times))
        log.info(
            "CPU attention: %s (decode batch: %s)",
            impl,
            ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()),
        )
    return impl


class ModelRunner:
    def __init__(self, config: EngineConfig, model: DecoderLM, sampler: Sampler):
        self.config, self.model, self.sampler = config, model, sampler
        self.device = model.device
        bs = config.block_size
        wanted = -(-config.max_model_len // bs) * config.max_num_seqs
        by_bytes = config.kv_cache_bytes // kv_block_bytes(model, bs, config.kv_cache_dtype)
        self.num_blocks = config.num_kv_blocks or min(by_bytes, wanted)
        if self.num_blocks * bs < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_blocks * bs} tokens, fewer than max_model_len "
                f"{config.max_model_len}: raise kv_cache_bytes / num_kv_blocks or lower "
                "max_model_len"
            )
        self.attentions = [layer.self_attn for layer in model.model.layers]
        eager = config.enforce_eager
        if eager is None:  # captured graphs on CUDA; the CPU runs its steps as they come
            eager = self.device.type != "cuda"
        graphs = not eager and DecodeGraphs.supports(model)
        # Graph-ready decode pads its batch with rows whose K/V go to one scratch block past
        # the pool's (never handed out): a slot of -1 is not skipped by every backend.
        kv_cache.allocate_kv_cache(
            self.attentions, self.num_blocks + graphs, bs, model.dtype, config.kv_cache_dtype,
            self.device,
        )  # fmt: skip
        impl = choose_cpu_attention(config, model) if self.device.type == "cpu" else "sdpa"
        self.cpu_attention = impl  # tensor parallelism: rank 0's choice is every rank's
        # This engine's kernels (its kernel_mode option, its own attention form), bound to its
        # model's modules: another engine in the process keeps its own.
        self.backend = kernel_backend.KernelBackend(mode=config.kernel_mode, cpu_attention=impl)
        kernel_backend.bind(model, self.backend)
        self.planner = StepPlanner(model, self.backend, bs)
        # The last step's sequences whose logits or prompt logprobs were not finite (NaN,
        # +inf): the engine ends each with an error of its own, and no other row notices.
        self.nonfinite: list[Sequence] = []
        self.graphs = None
        if graphs:
            max_blocks = -(-config.max_model_len // bs)
            self.graphs = DecodeGraphs(
                model, self.planner, config.max_num_seqs, max_blocks,
                scratch_slot=self.num_blocks * bs, capture=self.device.type == "cuda",
            )  # fmt: skip
            if self.graphs.capture:  # at start, as vLLM does, not at each bucket's first step
                with torch.inference_mode():
                    secs = self.graphs.capture_all(lora=config.enable_lora)
                log.info("decode graphs made for batch sizes %s in %.1f s",
                         self.graphs.buckets, secs)  # fmt: skip

    @property
    def kv_cache_bytes(self) -> int:
        cfg = self.config
        return self.num_blocks * kv_block_bytes(self.model, cfg.block_size, cfg.kv_cache_dtype)

    def prepare(self, out: SchedulerOutput, slots: dict[int, int]) -> StepBatch:
        bs = self.config.block_size
        order = sorted(range(len(out.seqs)), key=lambda i: slots.get(out.seqs[i].adapter_id, -1))
        ids: list[int] = []
        pos: list[int] = []
        slot_mapping: list[int] = []
        qsl, seq_lens, tables = [0], [], []
        segments: list[tuple[int, int, int]] = []
        sample_rows, sample_seqs = [], []
        prompt_rows = PromptRows()
        for i in order:
            seq, n = out.seqs[i], out.num_new_tokens[i]
            start, k = seq.num_computed_tokens, len(seq.spec_tokens)
            toks = seq.token_slice(start, start + n - k) + seq.spec_tokens
            ids.extend(toks)
            pos.extend(range(start, start + n))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            row0 = qsl[-1]
            qsl.append(row0 + n)
            seq_lens.append(start + n)
            tables.append(table)
            slot = slots.get(seq.adapter_id, -1)
            if segments and segments[-1][2] == slot:
                segments[-1] = (segments[-1][0], row0 + n, slot)
            else:
                segments.append((row0, row0 + n, slot))
            prompt_rows.add(seq, row0, start, n)
            if out.samples(i) and seq.params.max_tokens != 0:  # 0: score the prompt only
                # k + 1 rows with proposals: the last real token's and each proposal's.
                sample_rows += range(row0 + n - 1 - k, row0 + n)
                sample_seqs += [seq] * (k + 1)
                if seq.fork_children and not seq.output_token_ids:
                    # n > 1: the other samples draw their first token from the same logits.
                    sample_rows += [row0 + n - 1] * len(seq.fork_children)
                    sample_seqs += seq.fork_children
        seqs = [out.seqs[i] for i in order]
        if self.graphs is not None and qsl[-1] == len(seqs) and not prompt_rows.rows:
            # every row one sequence's one new token: a graph-ready decode step
            row_slots = [slots.get(seq.adapter_id, -1) for seq in seqs]
            return StepBatch(
                input_ids=None, positions=None, ctx=None, sample_rows=sample_rows,
                sample_seqs=sample_seqs, seqs=seqs, prompt_rows=prompt_rows,
                decode=DecodeInputs(ids, pos, slot_mapping, tables, seq_lens, row_slots),
            )  # fmt: skip
        width = max(len(t) for t in tables)
        block_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=self.device
        )
        dev = self.device
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        ctx = self.planner.plan(
            positions, torch.tensor(slot_mapping, dtype=torch.int64, device=dev), qsl,
            seq_lens, block_tables, segments,
        )  # fmt: skip
        return StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=positions,
            ctx=ctx,
            sample_rows=sample_rows,
            sample_seqs=sample_seqs,
            seqs=seqs,
            prompt_rows=prompt_rows,
        )

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source -> destination) in every layer (forked samples)."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        kv_cache.copy_kv_blocks(self.attentions, src, dst)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The final hidden states [rows, hidden] of a prepared step (engine/parallel/
        runtime.py sends the step to the other ranks first)."""
        if batch.decode is not None:
            return self.graphs.run(batch.decode)
        return self.model(batch.input_ids, batch.positions, batch.ctx)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, slots: dict[int, int]):
        """Run one step; returns (sampling sequences, SamplerOutput) or None if none sample.

        A sequence with k speculative proposals appears k + 1 times in a row."""
        batch = self.prepare(out, slots)
        hidden = self.forward(batch)
        self.nonfinite = []
        if batch.prompt_rows.rows:
            score_prompt_rows(self.model, hidden, batch.prompt_rows)
            self.nonfinite = _nonfinite_prompts(batch.prompt_rows)
        if not batch.sample_seqs:
            return None
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # [rows, vocab]
        seqs = batch.sample_seqs
        for s in seqs:
            if s.generator is None and s.seed is not None:
                s.generator = make_generator(s.seed, logits.device)
        # The j-th row of a speculating sequence follows its first j proposals.
        outputs, j = [], 0
        for r, s in enumerate(seqs):
            j = j + 1 if r and seqs[r - 1] is s else 0
            outputs.append(s.output_token_ids + s.spec_tokens[:j] if j else s.output_token_ids)
        result = self.sampler(
            logits,
            [s.params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            outputs,
            [s.generator for s in seqs],
            [s.processors for s in seqs],
            logits_owned=True,
        )
        for r in result.nonfinite:
            if seqs[r] not in self.nonfinite:
                self.nonfinite.append(seqs[r])
        return seqs, result


def _nonfinite_prompts(batch: PromptRows) -> list[Sequence]:
    """The sequences whose prompt logprobs scored this step are not finite. A logprob of
    -inf alone (a prompt token the model rules out) is reported as LOGPROB_FLOOR. Only the
    entries this step appended are read: earlier ones were checked in their own step."""
    bad: list[Sequence] = []
    for seq, n in Counter(batch.seqs).items():  # n: entries appended this step
        pl = seq.prompt_logprobs
        values = pl.token_logprobs[-n:] + [v for top in pl.top[-n:] for _, v in top]
        if not all(math.isfinite(v) or v == -math.inf for v in values):
            bad.append(seq)
        elif -math.inf in values:
            pl.token_logprobs[-n:] = [max(v, LOGPROB_FLOOR) for v in pl.token_logprobs[-n:]]
            pl.top[-n:] = [[(t, max(v, LOGPROB_FLOOR)) for t, v in top] for top in pl.top[-n:]]
    return bad
