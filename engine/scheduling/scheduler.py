"""Continuous batching by token budget.

Each step gives every running sequence up to its remaining tokens (one for a decode, a chunk
for a prefill) and then admits waiting sequences while the token budget, the sequence cap,
the adapter-slot cap and the KV pool allow. A sequence samples when a step brings its
computed tokens up to all of its tokens. When blocks run out, the policy's victim is preempted
by recompute (its blocks are freed and it waits again with its generated tokens kept) or,
with a host pool, by swap when the measured costs favour it (engine/memory/swap.py): its blocks are
copied to host memory and back when it is admitted again, its progress kept.

Invariant: the running sequences use at most `max_loras` distinct adapters, so every
adapter a step needs fits in a device slot and no adapter in use is ever evicted.

Adapters load in the background: a waiting sequence whose adapter is not in host memory yet
is skipped by admission (the step goes on without it) and admitted once the load is done.

KV tiers (engine/memory/tiers) look a new sequence's stored prefix up in the background from
`add` on: admission skips it until the lookup answers, then counts the blocks found as cached
and has the engine write them into fresh blocks (`SchedulerOutput.tier_in`) before the step.

Priority classes (`Sequence.priority`: 0 interactive, 1 the Batch API's lines): each step
serves the classes in order, each one's running sequences and then its admissions. A class is
admitted only while no more urgent sequence waits that could run; when one waits for a seat,
KV blocks or an adapter slot, the least urgent running sequences are preempted for it (an
adapter slot: every sequence of an adapter that only less urgent ones use), and on a KV
shortage the victim comes from the least urgent class. A step that computes a more urgent
prompt carries nothing of less urgent classes, and a step gives the less urgent classes at
most `config.max_batch_step_tokens` tokens (their prompts in chunks): a request that arrives
while a step runs waits for that step's end, so steps that carry batch work stay short.
Within a class the policy orders as always.

A paused sequence (its stream's reader fell behind) is in neither list: no step spends
tokens on it and it holds no batch slot, but it keeps its KV blocks, unless blocks run short:
then paused sequences give theirs back first (they recompute when resumed). Resumed, one that
kept its blocks goes straight back to the running set when a slot and an adapter slot allow;
one without blocks waits like any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.block_manager import BlockManager
from loraplex.engine.memory.swap import SwapSpace
from loraplex.engine.scheduling.admission import KVAdmission
from loraplex.engine.scheduling.policy import SchedulingPolicy, make_policy
from loraplex.engine.sequence import PRIORITY_INTERACTIVE, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed per seq
    preempted: list[Sequence] = field(default_factory=list)
    # Block copies the engine makes before the model runs, swap-outs first (engine/memory/swap.py).
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    # Prefix blocks found in the KV tiers, written into device blocks before the model runs.
    tier_in: list[tuple[bytes, int]] = field(default_factory=list)  # (payload, device)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        seq = self.seqs[i]  # speculated tokens are computed past num_tokens
        return seq.num_computed_tokens + self.num_new_tokens[i] >= seq.num_tokens


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        policy: SchedulingPolicy | None = None,
        adapter_loaded: Callable[[int], bool] | None = None,
        swap: SwapSpace | None = None,
    ):
        self.config = config
        self.block_manager = block_manager
        self.policy = policy or make_policy(config.scheduling_policy, config)
        # Whether an adapter's weights are in host memory, ready for a device slot.
        self.adapter_loaded = adapter_loaded or (lambda adapter_id: True)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.paused: list[Sequence] = []  # neither scheduled nor admitted until resumed
        self.resumed: list[Sequence] = []  # resumed with their blocks: back to running first
        self.num_preemptions = 0
        self.swap = swap  # the host KV pool, if any: preemption by swap
        self.tiers = None  # KV tiers below the device pool, if any (engine/memory/tiers)
        self.batch_step_tokens = config.max_batch_step_tokens
        # config.kv_admission: admit by expected KV growth, not by prompt alone
        self.admission = (
            KVAdmission(block_manager, config.max_model_len) if config.kv_admission else None
        )

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.policy.on_arrival(seq)
        if self.tiers is not None:  # look up its stored prefix while it queues
            self.tiers.request(seq)

    def has_unfinished(self) -> bool:
        """Whether a step has anything to do (paused sequences wait for a resume)."""
        return bool(self.waiting or self.running or self.resumed)

    def pause(self, seq: Sequence) -> None:
        """Take `seq` out of scheduling, keeping its blocks (a no-op if finished or paused)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.resumed:
            self.resumed.remove(seq)
        else:
            return
        seq.spec_tokens = []
        self.paused.append(seq)

    def resume(self, seq: Sequence) -> None:
        if seq not in self.paused:
            return
        self.paused.remove(seq)
        if seq.status is SequenceStatus.RUNNING and seq.block_table:
            self.resumed.append(seq)
        else:  # never admitted, preempted, or its blocks were taken while paused
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)

    def _release_paused(self) -> bool:
        """Free the blocks of one paused sequence (it recomputes once resumed); False if
        none holds any."""
        for seq in self.paused + self.resumed:
            if seq.block_table and seq.status is SequenceStatus.RUNNING:
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
                if seq in self.resumed:
                    self.resumed.remove(seq)
                    self.waiting.append(seq)
                self.num_preemptions += 1
                seq.num_preemptions += 1
                return True
        return False

    def _allocate(self, seq: Sequence, n: int, blocks: list[int] | None = None) -> bool:
        """allocate_slots, taking paused sequences' blocks when the pool is short."""
        while not self.block_manager.allocate_slots(seq, n, blocks):
            if not self._release_paused():
                return False
        return True

    def _readmit_resumed(self) -> None:
        """Resumed sequences that kept their KV rejoin the running set as caps allow."""
        adapters = self.running_adapters()
        for seq in list(self.resumed):
            if len(self.running) >= self.config.max_num_seqs:
                return
            a = seq.adapter_id
            if a and a not in adapters and len(adapters) >= self.config.max_loras:
                continue
            self.resumed.remove(seq)
            self.running.append(seq)
            if a:
                adapters.add(a)

    def running_adapters(self) -> set[int]:
        return {s.adapter_id for s in self.running if s.adapter_id}

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.spec_tokens = []
        if self.swap is None or not self.swap.swap_out(seq, out.swap_out):
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.append(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.swap is not None:
            self.swap.begin_step()
        if self.resumed:
            self._readmit_resumed()
        # Priority classes, most urgent first (`Sequence.priority`: 0 interactive, 1 batch).
        # Each class's running sequences, then its admissions; a class is admitted only while
        # no request of a more urgent one waits ready, so batch work fills what is left.
        admit = True
        low = self.batch_step_tokens  # what classes after the interactive one may still take
        for cls in sorted({s.priority for s in self.running} | {s.priority for s in self.waiting}):
            if out.seqs and any(s.num_computed_tokens < s.num_prompt_tokens for s in out.seqs):
                # A step that computes a more urgent prompt carries nothing less urgent: the
                # first token is what batch work would delay most (its tokens lengthen the step).
                break
            # A request that arrives while a step runs waits for the step's end, so a step
            # that carries batch work must stay short: the batch class gets at most
            # `batch_step_tokens` of it (its prompts in chunks, its decodes oldest first).
            cap = budget if cls == PRIORITY_INTERACTIVE else min(budget, max(0, low))
            left = self._schedule_running(cls, out, cap)
            if admit and not out.preempted:
                left, admit = self._admit(cls, out, left)
            if cls != PRIORITY_INTERACTIVE:
                low -= cap - left
            budget -= cap - left
            # A step that had to preempt admits nothing more: blocks are short, and a newer
            # request must not take the blocks an older one just gave up.
            if out.preempted:
                admit = False
        return out

    def _victim(self) -> Sequence:
        """Who gives its blocks back: the policy's choice within the least urgent class."""
        low = max(s.priority for s in self.running)
        return self.policy.preemption_victim([s for s in self.running if s.priority == low])

    def _schedule_running(self, cls: int, out: SchedulerOutput, budget: int) -> int:
        """Running sequences of class `cls` first, oldest first; preempt on a shortage."""
        for seq in [s for s in self.running if s.priority == cls]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            remaining = seq.num_tokens - seq.num_computed_tokens
            if seq.spec_tokens:  # a decode with proposals: score them in the same pass
                seq.spec_tokens = seq.spec_tokens[: max(0, budget - remaining)]
            n = min(remaining + len(seq.spec_tokens), budget)
            while not self._allocate(seq, n):
                victim = self._victim()
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim in out.seqs:  # already given tokens this step: take them back
                    i = out.seqs.index(victim)
                    budget += out.num_new_tokens.pop(i)
                    out.seqs.pop(i)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return budget

    def _make_room(self, cls: int, out: SchedulerOutput, adapter: int = 0) -> bool:
        """Preempt a running sequence of a less urgent class than `cls` (with `adapter`: every
        one of some adapter only such sequences use, freeing its slot). False if none can."""
        lower = [s for s in self.running if s.priority > cls]
        if adapter:
            urgent = {s.adapter_id for s in self.running if s.priority <= cls}
            spare = {s.adapter_id for s in lower if s.adapter_id} - urgent
            if not spare:
                return False
            # The adapter with the fewest sequences to preempt.
            a = min(spare, key=lambda a: sum(s.adapter_id == a for s in lower))
            victims = [s for s in lower if s.adapter_id == a]
        else:
            victims = [self._victim()] if lower else []
        for victim in victims:
            self._preempt(victim, out)
            out.preempted.append(victim)
        return bool(victims)

    def _admit(self, cls: int, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Admit waiting sequences of class `cls`, making room by preempting less urgent
        ones. Returns the budget left and whether less urgent classes may be admitted (no
        sequence of this class is left waiting that could run but for room)."""
        cfg = self.config
        waiting = [s for s in self.waiting if s.priority == cls]
        adapters = self.running_adapters()
        for seq in self.policy.admission_order(waiting):
            # A request with n > 1 brings its other samples into the running set at once.
            if budget == 0:
                break
            loading = seq.adapter_id and not self.adapter_loaded(seq.adapter_id)

            def over(seq=seq) -> bool:
                return len(self.running) + 1 + len(seq.fork_children) > cfg.max_num_seqs

            while over() and not loading and self._make_room(cls, out):
                pass
            if over():
                break
            if loading:
                continue  # still loading in the background; never wait for it
            a = seq.adapter_id
            while a and a not in adapters and len(adapters) >= cfg.max_loras:
                if not self._make_room(cls, out, adapter=a):
                    break
                adapters = self.running_adapters()
            if a and a not in adapters and len(adapters) >= cfg.max_loras:
                self.policy.on_blocked(seq)
                continue  # its adapter needs a slot; others may still fit
            seq.spec_tokens = []
            blocks, num_cached = self.block_manager.get_computed_blocks(seq)
            loaded = self.tiers.take(seq, len(blocks)) if self.tiers is not None else []
            if loaded is None:
                continue  # its tier lookup is under way: it waits, others run
            extra = len(loaded) * self.block_manager.block_size  # fresh blocks, filled from tiers
            num_cached += extra
            while self.admission and not self.admission.fits(seq, self.running, num_cached):
                if not self._make_room(cls, out):
                    break
            if self.admission and not self.admission.fits(seq, self.running, num_cached):
                break  # its expected KV growth does not fit (engine/scheduling/admission.py)
            # A swapped-out sequence kept its progress; others start at the cached prefix.
            start = max(num_cached, seq.num_computed_tokens)
            n = seq.num_tokens - start
            if n > budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            allocated = self._allocate(seq, n + extra, blocks)
            while not allocated and self._make_room(cls, out):
                allocated = self._allocate(seq, n + extra, blocks)
            if not allocated:
                break
            self.block_manager.record_prefix_lookup(num_cached)
            if self.swap is not None and self.swap.is_swapped(seq):
                self.swap.swap_in(seq, len(blocks), out.swap_in)
            if loaded:
                fresh = seq.block_table[len(blocks) : len(blocks) + len(loaded)]
                out.tier_in += zip(loaded, fresh, strict=True)
            if self.tiers is not None:
                self.tiers.admitted(seq, len(blocks), len(loaded))
            seq.num_computed_tokens = start
            seq.num_cached_tokens = max(seq.num_cached_tokens, num_cached)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            self.waiting.remove(seq)
            self.running.append(seq)
            self.policy.on_admitted(seq)
            if seq.adapter_id:
                adapters.add(seq.adapter_id)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        ready = any(
            s.priority == cls and (not s.adapter_id or self.adapter_loaded(s.adapter_id))
            for s in self.waiting
        )
        return budget, not ready

    def postprocess(self, out: SchedulerOutput, sampled: dict[int, list[int]]) -> list[Sequence]:
        """Advance progress; append each sequence's new tokens. Returns those that sampled.

        `sampled` maps `seq.seq_no` to its new token ids: one, or with speculation the
        accepted proposals and the token drawn after them. KV slots of rejected proposals
        do not count as computed, and blocks holding only them are freed.
        """
        stepped = []
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled.get(seq.seq_no)
            rejected = len(seq.spec_tokens) - (len(tokens) - 1) if tokens else 0
            seq.spec_tokens = []
            seq.num_computed_tokens += n - rejected
            if rejected:
                self.block_manager.trim(seq)
            if tokens is not None:  # first: accepted proposals count as computed tokens
                now = time.time()
                seq.first_token_time = seq.first_token_time or now
                seq.last_token_time = now
                seq.output_token_ids += tokens
                self.policy.on_tokens(seq, len(tokens))
                stepped.append(seq)
            self.block_manager.cache_full_blocks(seq)
        return stepped

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Start `child`, a sibling sample of `parent` that sampled its first token at the
        step that computed `parent`'s prompt, on `parent`'s prompt KV. Returns the block
        copies the runner must make. Without a free block for the copy the child waits and
        recomputes its prompt like a preempted sequence (the prefix cache serves most of it).
        """
        copies = self.block_manager.fork(parent, child, parent.num_prompt_tokens)
        self.policy.on_forked(child)
        if copies is None:
            child.status = SequenceStatus.WAITING
            self.waiting.append(child)
            return []
        child.num_computed_tokens = parent.num_prompt_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        self.policy.on_tokens(child, 1)
        return copies

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (or abort) a sequence wherever it is and free everything it holds."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        for held in (self.paused, self.resumed):
            if seq in held:
                held.remove(seq)
        self.block_manager.free(seq)
        if self.swap is not None:
            self.swap.free(seq)
        if self.tiers is not None:
            self.tiers.forget(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.policy.on_finished(seq)
        if self.admission:
            self.admission.on_finished(seq, reason)
