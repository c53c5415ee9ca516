"""The synchronous engine: add_request / step / abort.

One step reads schedule -> run -> sample -> process: the scheduler picks sequences and token
counts, the model runner computes them and samples, the scheduler advances progress, and the
output processor (engine/output_processor.py) turns the new tokens into text, stop decisions
and outputs. This class wires them together and owns the requests' lifetimes (blocks,
adapter references, the samples of n > 1).

Adapters load in the background from `add_request` on; a request whose adapter fails to load
finishes with `finish_reason="error"` and `error` set, and no other request notices.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from functools import partial

import torch

from loraplex.engine.adapters.manager import AdapterManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import BadRequestError, NonFiniteOutput
from loraplex.engine.memory import tiers as kv_tiers
from loraplex.engine.memory.block_manager import BlockManager
from loraplex.engine.memory.budget import MemoryReport, gpu_pool_bytes, step_working_bytes
from loraplex.engine.memory.swap import HostKVCache, SwapSpace, num_host_blocks
from loraplex.engine.models.tokenizer import Tokenizer
from loraplex.engine.output_processor import OutputProcessor, RequestState, SampleState
from loraplex.engine.outputs import PromptLogprobs, RequestOutput
from loraplex.engine.parallel.runtime import TensorParallel, TPAdapterManager, TPModelRunner
from loraplex.engine.sampling import structured_output  # noqa: F401  (registers the "grammar" kind)
from loraplex.engine.sampling.logits_processors import ProcessorContext, build_processors
from loraplex.engine.sampling.sampler import Sampler
from loraplex.engine.sampling.speculative import (
    NgramProposer,
    SpecDecodeStats,
    SpecPlanner,
    accept_prefix,
)
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduling.scheduler import Scheduler
from loraplex.engine.sequence import LoRARequest, Sequence, SequenceStatus
from loraplex.engine.stats import AdapterLoads
from loraplex.engine.step.model_runner import ModelRunner
from loraplex.engine.weights.loader import load_model
from loraplex.engine.weights.quantization import resident_weight_bytes

log = logging.getLogger("loraplex.engine")


def describe_device(device: torch.device) -> str:
    """The device as the start log names it: "cpu", or "cuda:0 (<the GPU's name>)"."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


@dataclass
class _AdapterLoad:
    """One request's adapter on its way into a device slot (RequestMetrics.adapter_*),
    measured here, where the engine asks the adapter manager for it."""

    name: str
    tier: str  # where the adapter was when the request arrived: device | host | disk
    asked: float  # time.monotonic() when the request asked for it
    in_host: float | None = None  # when the engine took a disk load into host memory
    seconds: float | None = None  # the request's wait, once its first step has it in a slot


def _sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s own seed: the request's seed for the first, derived for the others."""
    if seed is None or index == 0:
        return seed
    return (seed * 1_000_003 + index) % 2**63


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = False):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide: the engine is the user
        self.tokenizer = Tokenizer.from_dir(config.model)
        # tensor parallelism (engine/parallel): this process is rank 0 and holds a shard
        self.tp = TensorParallel(config) if config.tensor_parallel_size > 1 else None
        self.model = load_model(
            config.model,
            config.torch_dtype,
            config.device,
            max_len=config.max_model_len,
            progress=progress,
            quantization=config.quantization,
            shard=None if self.tp is None else self.tp.shard,
        )
        if self.tp is not None:
            self.tp.attach(self.model)
        spec = self.model.spec
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        # Adapter slots first: they come out of the same device budget as the KV pool.
        slots = config.max_loras if config.enable_lora else 0
        manager = AdapterManager if self.tp is None else partial(TPAdapterManager, self.tp)
        self.adapters = manager(
            self.model, slots, config.max_lora_rank, config.max_cpu_loras,
            expert_lora=config.expert_lora,
        )  # fmt: skip
        slot_bytes = self.adapters.slot_bytes
        runner_config = config
        budget, source = config.kv_cache_bytes, "kv_cache_bytes"  # slots + KV pool
        if config.num_kv_blocks is None:
            if self.model.device.type == "cuda" and config.gpu_memory_utilization is not None:
                budget = slot_bytes + self._gpu_pool_bytes(config, spec)
                source = "gpu_memory_utilization"
            if slot_bytes >= budget:
                experts = " (or expert_lora=False)" if self.adapters.expert_lora else ""
                raise ValueError(
                    f"the adapter slots need {slot_bytes} bytes, all of the {budget} that "
                    f"{source} ({getattr(config, source)}) leaves them; raise {source} or "
                    f"lower max_loras / max_lora_rank{experts}"
                )
            runner_config = copy.copy(config)  # the runner sizes its pool from what is left
            runner_config.kv_cache_bytes = budget - slot_bytes
        sampler = Sampler(self.eos_token_ids, seed=config.seed)
        if self.tp is None:
            self.runner = ModelRunner(runner_config, self.model, sampler)
        else:
            self.runner = TPModelRunner(self.tp, runner_config, self.model, sampler)
        self.memory = MemoryReport(
            budget_bytes=max(budget, slot_bytes + self.runner.kv_cache_bytes),
            adapter_slot_bytes=slot_bytes,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            num_kv_blocks=self.runner.num_blocks,
            weight_bytes=resident_weight_bytes(self.model),
            quantization=getattr(self.model, "quantization", None),
            dtype=str(self.model.dtype).removeprefix("torch."),
            block_size=config.block_size,
            adapter_slots=slots,
            max_lora_rank=config.max_lora_rank,
            host_adapters=config.max_cpu_loras,
            device=describe_device(self.model.device),
        )
        log.info("memory: %s", self.memory.summary())
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.host_kv, swap = self._make_swap_space(config)
        self.scheduler = Scheduler(
            config, self.block_manager, adapter_loaded=self.adapters.loaded, swap=swap
        )
        self.kv_tiers = kv_tiers.attach(self)  # host / disk / shared KV below the pool, or None
        self.vocab_size = spec.vocab_size
        self.processor_context = ProcessorContext(
            vocab_size=spec.vocab_size,
            eos_token_ids=frozenset(self.eos_token_ids),
            tokenizer=self.tokenizer,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, config.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self.load_errors: dict[str, Exception] = {}  # request id -> why its adapter failed
        self._pending: list[RequestOutput] = []  # outputs made outside a step
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model, all steps
        self.num_generated_tokens = 0  # tokens sampled, all requests, all steps
        self.num_steps = 0  # steps that ran the model
        self.proposer = None
        if config.num_speculative_tokens:
            self.proposer = NgramProposer(config.num_speculative_tokens)
        # Trims drafts to what pays on this hardware (None: score every proposal).
        self.spec_planner = SpecPlanner() if self.proposer else None
        self.spec_stats = SpecDecodeStats()
        self.adapter_loads = AdapterLoads()
        self._adapter_load: dict[str, _AdapterLoad] = {}  # request id -> its adapter's load
        self._unplaced: dict[str, _AdapterLoad] = {}  # of those, not yet in a slot
        self._reading: dict[int, list[_AdapterLoad]] = {}  # lora id -> loads waiting on disk

    def _gpu_pool_bytes(self, config: EngineConfig, spec) -> int:
        """The KV pool's bytes on this engine's GPU under gpu_memory_utilization, with the
        weights and adapter slots already allocated (memory.gpu_pool_bytes)."""
        device = self.model.device
        free, total = torch.cuda.mem_get_info(device)
        working = step_working_bytes(
            spec.hidden_size, spec.q_size + 2 * spec.kv_size,
            max(spec.intermediate_size, spec.top_k * spec.moe_intermediate_size),
            spec.vocab_size, self.model.dtype.itemsize, config.max_num_batched_tokens,
            config.max_num_seqs,
        )  # fmt: skip
        in_use = torch.cuda.memory_allocated(device)
        pool = gpu_pool_bytes(total, free, in_use, config.gpu_memory_utilization, working)
        mib = 2**20
        log.info(
            "GPU memory: %.0f MiB in all, %.0f free; weights and adapter slots %.0f MiB, a "
            "step's working memory up to %.0f MiB: %.0f MiB for the KV pool "
            "(gpu_memory_utilization %s)",
            total / mib, free / mib, in_use / mib, working / mib, pool / mib,
            config.gpu_memory_utilization,
        )  # fmt: skip
        return pool

    def _make_swap_space(self, config: EngineConfig):
        """The host KV pool for preemption by swap and its measured copy costs (or none)."""
        runner = self.runner
        n = num_host_blocks(config, runner.kv_cache_bytes // runner.num_blocks)
        if not n:
            return None, None
        host = HostKVCache(runner.attentions, n, runner.device)
        costs = host.measure(runner.num_blocks)
        log.info("host KV pool: %d blocks (%d bytes); copy costs %s", n, host.nbytes, costs)
        return host, SwapSpace(self.block_manager, n, costs, config.preemption_mode)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
        wait_for_adapter: bool = True,
        priority: int = 0,
        resume=None,
    ) -> None:
        """Queue a request. Raises ValueError (or AdapterError) for bad input, queuing nothing.

        The adapter starts loading now. With `wait_for_adapter` (offline use) this call waits
        for it and raises if it cannot be served; without (servers), it returns at once and a
        failed load finishes the request with an error output at a later step.
        `priority`: the request's class (0 interactive, 1 batch; engine/sequence.py).
        `resume`: the first tokens a prefill worker drew (engine/disagg/resume.py): the
        request continues after them.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not weight > 0:
            raise ValueError(f"the fair-share weight must be positive, got {weight!r}")
        if not isinstance(priority, int) or priority < 0:
            raise ValueError(f"priority must be a non-negative integer, got {priority!r}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        # The checks that need the model: typed errors that name the request field to blame.
        if not ids:
            raise BadRequestError("the prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise BadRequestError(
                f"prompt token ids must lie in [0, {self.vocab_size})", param="prompt"
            )
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise BadRequestError(
                f"the prompt has {len(ids)} tokens; this model serves at most {limit} tokens "
                "including the output",
                param="prompt",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise BadRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length {limit}",
                param="max_tokens",
            )
        samples = params.num_samples
        if samples > self.config.max_num_seqs:
            raise BadRequestError(
                f"n / best_of ({samples}) exceeds the engine's max_num_seqs "
                f"({self.config.max_num_seqs})",
                param="best_of" if params.best_of else "n",
            )
        if lora_request is not None and not self.config.enable_lora:
            raise BadRequestError(
                f"this engine serves the base model alone (enable_lora=False): no adapter "
                f"({lora_request.lora_name!r}) can be named",
                param="model",
            )
        processors = []
        if params.has_processors:
            processors = build_processors(params, self.processor_context)
        if lora_request is not None:
            self._adapter_asked(request_id, lora_request)
            self.adapters.acquire(lora_request)
            if wait_for_adapter and not self.adapters.loaded(lora_request.lora_int_id):
                self.adapters.wait(lora_request.lora_int_id)
                err = self._poll_adapters().get(lora_request.lora_int_id)
                if err is not None:
                    self.adapters.release(lora_request)
                    self._adapter_load.pop(request_id, None)
                    self._unplaced.pop(request_id, None)
                    raise err
        self.load_errors.pop(request_id, None)
        arrival, arrival_time = time.monotonic(), time.time()
        seqs = [
            Sequence(
                request_id,
                ids,
                params,
                lora=lora_request,
                tenant=tenant,
                weight=weight,
                priority=priority,
                arrival=arrival,
                arrival_time=arrival_time,
                processors=processors if index == 0 else [p.fork() for p in processors],
                index=index,
                seed=_sample_seed(params.seed, index),
            )
            for index in range(samples)
        ]
        if params.prompt_logprobs is not None:  # one request, one prompt: the first sample's
            seqs[0].prompt_logprobs = PromptLogprobs()
        group = self.outputs.new_request(text, seqs)
        if resume is not None:  # every sample has its first token: no fork
            self.requests[request_id] = group
            return resume.start(self, group)
        first = group.samples[0].seq
        first.fork_children = [r.seq for r in group.samples[1:]]
        self.requests[request_id] = group
        self.scheduler.add(first)

    def _adapter_asked(self, request_id: str, lora: LoRARequest) -> None:
        """Note where the request's adapter is now, before the manager is asked for it."""
        lora_id, ad = lora.lora_int_id, self.adapters
        tier = "device" if lora_id in ad.slots else "host" if ad.loaded(lora_id) else "disk"
        load = _AdapterLoad(lora.lora_name, tier, time.monotonic())
        self._adapter_load[request_id] = self._unplaced[request_id] = load
        if tier == "disk":
            self._reading.setdefault(lora_id, []).append(load)

    def _adapters_placed(self, seqs: list[Sequence], written: set[int], seconds: float) -> None:
        """The requests whose first step this is have their adapter in a slot now: their
        wait is the disk read (asked to taken in) plus this step's slot writes, if it wrote
        theirs (every adapter written waited for the whole activation)."""
        for seq in seqs:
            load = self._unplaced.pop(seq.request_id, None)
            if load is None:
                continue
            read = load.in_host - load.asked if load.in_host is not None else 0.0
            load.seconds = read + (seconds if seq.adapter_id in written else 0.0)
            self.adapter_loads.record(load.name, load.tier, load.seconds)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; returns its final output."""
        group = self.requests.get(request_id)
        if group is None:
            return None
        for req in group.samples:
            self._finish(req, "abort")
        return self._output(group)

    def pause(self, request_id: str) -> None:
        """Stop spending steps on a request, keeping its KV (a stream whose client stopped
        reading); a no-op for a request that finished or is unknown."""
        group = self.requests.get(request_id)
        for req in group.samples if group is not None else []:
            self.scheduler.pause(req.seq)

    def resume(self, request_id: str) -> None:
        group = self.requests.get(request_id)
        for req in group.samples if group is not None else []:
            self.scheduler.resume(req.seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """On stop, after the last step: the KV tiers store their queued writes, within
        their bound (engine/memory/tiers/manager.py FLUSH_ON_CLOSE_S), and stop."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.tp is not None:  # the other ranks stop
            self.tp.close()

    # ----------------------------------------------------------------- stepping
    def _poll_adapters(self) -> dict[int, Exception]:
        """Take in finished adapter loads; fail the requests of each load that failed."""
        failed = self.adapters.poll()
        if self._reading:  # the loads that finished now: their requests' reads end here
            now = time.monotonic()
            for lora_id in [i for i in self._reading if i not in self.adapters.loading]:
                for load in self._reading.pop(lora_id):
                    load.in_host = now
        for lora_id, err in failed.items():
            for group in list(self.requests.values()):
                seq = group.samples[0].seq
                if seq.adapter_id != lora_id or seq.is_finished:
                    continue
                assert seq.status is SequenceStatus.WAITING, "admitted before its adapter loaded"
                self.load_errors[seq.request_id] = err
                for req in group.samples:
                    self._finish(req, "error")
                output = self._output(group)
                output.error = f"adapter '{seq.lora.lora_name}' cannot be served: {err}"
                self._pending.append(output)
        return failed

    def step(self) -> list[RequestOutput]:
        self._poll_adapters()
        outputs, self._pending = self._pending, []
        if self.proposer is not None:
            self._propose()
        out = self.scheduler.schedule()
        if self.host_kv is not None:  # before the model writes any block freed by a swap-out
            self.host_kv.swap_out(out.swap_out)
            self.host_kv.swap_in(out.swap_in)
        if out.tier_in:  # prefix blocks the KV tiers found, before the model attends to them
            self.kv_tiers.load(out.tier_in)
        if not out.seqs:
            if not self.scheduler.running:  # only loads to wait for: do not spin
                self.adapters.wait_any(0.01)
                if self.kv_tiers is not None:  # or KV tier lookups
                    self.kv_tiers.wait_lookups(0.01)
            return outputs
        ids = {s.adapter_id for s in out.seqs if s.adapter_id}
        if self._unplaced:  # some request waits for its adapter: time the slot writes
            written = ids.difference(self.adapters.slots)
            start = time.perf_counter()
            slots = self.adapters.activate(ids, self.scheduler.running_adapters())
            self._adapters_placed(out.seqs, written, time.perf_counter() - start)
        else:
            slots = self.adapters.activate(ids, self.scheduler.running_adapters())
        self.num_prompt_tokens_computed += sum(
            max(0, min(s.num_computed_tokens + n, s.num_prompt_tokens) - s.num_computed_tokens)
            for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
        )
        t0 = time.perf_counter()
        sampled = self._run(out, slots)
        spec_rows = sum(len(s.spec_tokens) for s in out.seqs)
        if self.spec_planner and out.num_batched_tokens == len(out.seqs) + spec_rows:
            self.spec_planner.observe_step(out.num_batched_tokens, time.perf_counter() - t0)
        if self.host_kv is not None:  # what a recompute costs here, per token
            seconds = time.perf_counter() - t0
            self.scheduler.swap.costs.observe_step(out.num_batched_tokens, seconds)
        stepped = self.scheduler.postprocess(out, sampled)
        if self.kv_tiers is not None:  # queue this step's new prefix blocks for the tiers
            self.kv_tiers.offload()
        if self.runner.nonfinite:  # each ends with its own error; `_run` gave them no tokens
            outputs += self._fail_nonfinite(self.runner.nonfinite)
            stepped = [seq for seq in stepped if not seq.is_finished]
        self.num_steps += 1
        self.num_generated_tokens += sum(len(t) for t in sampled.values())
        for seq in out.seqs:  # max_tokens=0 scores the prompt: done once it is computed
            scored = seq.num_computed_tokens >= seq.num_prompt_tokens
            if seq.params.max_tokens == 0 and scored and not seq.is_finished:
                self._finish(self.requests[seq.request_id].samples[seq.index], "length")
                stepped.append(seq)
        return outputs + self._process(stepped, sampled)

    def _run(self, out, slots: dict[int, int]) -> dict[int, list[int]]:
        """Run the model and sample; returns seq_no -> new tokens of each sequence that sampled
        (one, or with proposals the accepted ones and the token drawn after them)."""
        result = self.runner.run(out, slots)
        sampled: dict[int, list[int]] = {}
        if result is None:
            return sampled
        seqs, so = result
        r = 0
        while r < len(seqs):
            seq = seqs[r]
            k = len(seq.spec_tokens)
            rows = range(r, r + k + 1)
            if seq in self.runner.nonfinite:
                r += k + 1
                continue
            tokens = [so.token_ids[i] for i in rows]
            if k:
                tokens = accept_prefix(seq.spec_tokens, tokens)
                seq.spec_proposed += k
                seq.spec_accepted += len(tokens) - 1
                self.spec_stats.record(k, len(tokens) - 1)
                if self.spec_planner:
                    self.spec_planner.observe_draft(seq.seq_no, k, len(tokens) - 1)
            sampled[seq.seq_no] = tokens
            for proc in seq.processors:
                proc.accept(tokens[0])  # processors' requests are never speculated
            if seq.params.logprobs is not None or seq.params.best_of:
                for i in rows[: len(tokens)]:  # row j drew the j-th new token
                    seq.logprobs.append(so.logprobs[i])
                    seq.top_logprobs.append(so.top_logprobs[i] or [])
            r += k + 1
        return sampled

    def _fail_nonfinite(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """End the requests whose logits were not finite with a NonFiniteOutput error."""
        outputs = []
        for rid in dict.fromkeys(seq.request_id for seq in seqs):
            group = self.requests.get(rid)
            if group is None or group.finished:
                continue
            seq = group.samples[0].seq
            why = (
                "the adapter's weights are beyond what can be served"
                if seq.lora
                else ("the base model's activations overflowed its dtype")
            )
            err = NonFiniteOutput(
                f"the request's logits came out non-finite (NaN or infinity): {why}"
            )
            self.load_errors[rid] = err
            for req in group.samples:
                self._finish(req, "error")
            output = self._output(group)
            if output is not None:
                output.error = str(err)
                output.prompt_logprobs = None  # they may hold the NaN that ended it
                outputs.append(output)
        return outputs

    def _propose(self) -> None:
        """Speculative proposals for the running decodes that may take them."""
        cfg, proposer = self.config, self.proposer
        decodes, drafts = [], {}
        for seq in self.scheduler.running:
            p = seq.params
            if seq.processors or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            decodes.append(seq)
            drafts[seq.seq_no] = []
            if seq.spec_proposed >= 32 and seq.spec_accepted < 0.1 * seq.spec_proposed:
                continue  # proposals rarely land for this request: stop paying for them
            # Room for all k proposals and the bonus token within max_tokens and the context.
            k = cfg.num_speculative_tokens
            k = min(k, cfg.max_model_len - seq.num_tokens - 1)
            if p.max_tokens is not None:
                k = min(k, p.max_tokens - len(seq.output_token_ids) - 1)
            if k > 0:
                drafts[seq.seq_no] = proposer.propose(seq.all_token_ids, k)
        keep = self.spec_planner.plan(drafts) if self.spec_planner else {}
        for seq in decodes:
            seq.spec_tokens = drafts[seq.seq_no][: keep.get(seq.seq_no, len(drafts[seq.seq_no]))]

    def _process(
        self, stepped: list[Sequence], sampled: dict[int, list[int]]
    ) -> list[RequestOutput]:
        """Fork n > 1 samples whose prompt is done, apply stop conditions, build outputs."""
        for seq in list(stepped):
            if seq.fork_children and len(seq.output_token_ids) == 1:
                stepped += self._fork(seq, sampled)
        changed: dict[str, RequestState] = {}
        for seq in stepped:
            group = self.requests[seq.request_id]
            sample = group.samples[seq.index]
            stop = self.outputs.check_stop(sample)
            if stop is not None:
                self._finish(sample, stop.reason, stop.stop_reason)
            changed[seq.request_id] = group
        outputs = []
        for group in changed.values():
            output = self._output(group)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fork(self, seq: Sequence, sampled: dict[int, list[int]]) -> list[Sequence]:
        """Start `seq`'s sibling samples on its computed prompt, each with the first token it
        drew from the same logits this step."""
        children, seq.fork_children = seq.fork_children, []
        for child in children:
            child.output_token_ids += sampled[child.seq_no]
            child.first_token_time = child.last_token_time = time.time()
            self.runner.copy_blocks(self.scheduler.fork(seq, child))
        return children

    def _finish(
        self, sample: SampleState, reason: str, stop_reason: str | int | None = None
    ) -> None:
        seq = sample.seq
        if seq.is_finished:
            return
        self.scheduler.finish(seq, reason)
        seq.stop_reason = stop_reason
        children, seq.fork_children = seq.fork_children, []
        for child in children:  # never started (abort, adapter error): not in the scheduler
            child.status, child.finish_reason = SequenceStatus.FINISHED, reason
        if seq.lora is not None and self.requests[seq.request_id].finished:
            self.adapters.release(seq.lora)  # once per request, by its last sample
        self.outputs.finished(sample)

    def _output(self, group: RequestState) -> RequestOutput | None:
        output = group.output()
        request_id = group.samples[0].seq.request_id
        load = self._adapter_load.get(request_id) if self._adapter_load else None
        if load is not None and output is not None and output.metrics is not None:
            output.metrics.adapter_tier = load.tier
            output.metrics.adapter_load_time = load.seconds
        if group.finished:
            self.requests.pop(request_id, None)
            if load is not None:
                self._adapter_load.pop(request_id, None)
                self._unplaced.pop(request_id, None)
        return output
