"""The two roles over one LLMEngine each: `PrefillWorker` (the prompt and the first token,
then a `Handoff`) and `DecodeWorker` (the rest of the request from a `Handoff`).

    client ─▶ PrefillWorker.add_request ─ step ─▶ RequestOutput (done at the first token)
                                               └▶ Handoff ─▶ DecodeWorker.add_handoff
                                                              step ─▶ RequestOutputs (the stream)

Both engines need the KV tiers (kv_tier_* options) on one store they share: host or disk
for two engines on one host that share the folder / process, the shared store (Redis)
between hosts. Without a shared tier the decode worker computes the whole prompt itself:
slower, still exact.

The prefill worker runs the request with max_tokens=1 (min_tokens and everything else kept,
so the first token is drawn as one engine draws it). A request that ends there (a stop
string, EOS, max_tokens=1, an adapter error) is answered by the prefill worker; every other
request becomes a Handoff once its prompt blocks are stored (the writes are flushed first, so
the decode worker's lookup finds them all).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from loraplex.engine.disagg.handoff import FirstToken, Handoff
from loraplex.engine.disagg.resume import Resume
from loraplex.engine.disagg.store import share_disk_tier
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest, Sequence

# The most a prefill step waits for its prompt blocks to be stored before handing off: a
# block not stored by then is computed again by the decode worker (slower, still exact).
PUBLISH_TIMEOUT_S = 10.0


@dataclass
class _Prefilling:
    params: SamplingParams  # the request's own
    lora: LoRARequest | None
    tenant: str | None
    seqs: list[Sequence]  # its samples, held past the engine's finish to read their state


def first_token_params(params: SamplingParams) -> SamplingParams:
    """The request's params for its prefill: one token, everything else as asked (a copy made
    without re-checking: min_tokens may exceed 1, which still masks EOS for the first draw)."""
    p = copy.copy(params)
    if p.max_tokens != 0:
        p.max_tokens = 1
    return p


class PrefillWorker:
    def __init__(self, engine):
        self.engine = engine
        share_disk_tier(engine)
        self._live: dict[str, _Prefilling] = {}
        self.handoffs = 0  # requests handed to a decode worker
        self.answered = 0  # requests that ended at their first token here

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None, tenant: str | None = None,
                    **kw) -> None:  # fmt: skip
        params = params or SamplingParams()
        self.engine.add_request(
            request_id, prompt, first_token_params(params), lora_request, tenant=tenant, **kw
        )
        seqs = [s.seq for s in self.engine.requests[request_id].samples]
        self._live[request_id] = _Prefilling(params, lora_request, tenant, seqs)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is here; its blocks are freed at once."""
        if self._live.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput | Handoff]:
        """One engine step: the outputs of requests that ended here, and the handoffs of those
        that go on (after their prompt blocks are stored)."""
        done: list[RequestOutput | Handoff] = []
        ready: list[Handoff] = []
        for out in self.engine.step():
            p = self._live.get(out.request_id)
            if p is None or not out.finished:
                continue  # an aborted request's last output, or a chunk of n > 1
            del self._live[out.request_id]
            if self._ends_here(out, p):
                self.answered += 1
                done.append(out)
            else:
                ready.append(self._handoff(out, p))
        tiers = self.engine.kv_tiers
        if ready and tiers is not None:
            tiers.flush(PUBLISH_TIMEOUT_S)
        self.handoffs += len(ready)
        return done + ready

    def _ends_here(self, out: RequestOutput, p: _Prefilling) -> bool:
        if out.error is not None:
            return True
        limit = self.engine.config.max_model_len
        for seq in p.seqs:
            if seq.finish_reason != "length":
                continue  # stop, abort, error: final
            if p.params.max_tokens is not None and len(seq.output_token_ids) >= p.params.max_tokens:
                continue
            if seq.num_tokens >= limit:
                continue
            return False  # this sample goes on
        return True

    def _handoff(self, out: RequestOutput, p: _Prefilling) -> Handoff:
        samples = []
        for seq in p.seqs:
            g = seq.generator
            samples.append(
                FirstToken(
                    token=seq.output_token_ids[0],
                    logprob=seq.logprobs[0] if seq.logprobs else None,
                    top=list(seq.top_logprobs[0]) if seq.top_logprobs else [],
                    generator_state=bytes(g.get_state().numpy()) if g is not None else None,
                )
            )
        bs = self.engine.config.block_size
        metrics = out.metrics
        return Handoff(
            request_id=out.request_id,
            prompt=out.prompt,
            prompt_token_ids=list(out.prompt_token_ids),
            params=p.params,
            samples=samples,
            lora=p.lora,
            tenant=p.tenant,
            prompt_logprobs=out.prompt_logprobs,
            num_cached_tokens=out.num_cached_tokens,
            arrival_time=metrics.arrival_time if metrics else time.time(),
            first_token_time=metrics.first_token_time if metrics else None,
            kv_blocks=len(out.prompt_token_ids) // bs,
        )


class DecodeWorker:
    def __init__(self, engine, found: dict[str, int] | None = None):
        self.engine = engine
        share_disk_tier(engine)
        self._live: dict[str, Handoff] = {}
        self.tokens_loaded = 0  # prompt tokens found stored, not computed, over all handoffs
        # When given: each request's prompt tokens this engine found stored (the KV tiers, its
        # prefix cache) rather than computed, for the caller to pop (a worker's trace span).
        self.found = found

    def add_handoff(self, handoff: Handoff, lora_request: LoRARequest | None = None,
                    **kw) -> RequestOutput | None:  # fmt: skip
        """Continue `handoff`'s request here (`lora_request`: this worker's own name for the
        same adapter version, default the prefill worker's); returns its first output (the
        first tokens' text; finished if they ended it), None for best_of until the end."""
        params = copy.copy(handoff.params)
        params.prompt_logprobs = None  # scored by the prefill worker: its prefix may be loaded
        self.engine.add_request(
            handoff.request_id,
            handoff.prompt_token_ids,
            params,
            lora_request or handoff.lora,
            tenant=handoff.tenant,
            resume=(resume := Resume(handoff)),
            **kw,
        )
        self._live[handoff.request_id] = handoff
        out = resume.output
        return self._as_one_engine(out) if out is not None else None

    def abort(self, request_id: str) -> RequestOutput | None:
        if self._live.pop(request_id, None) is None:
            return None
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs, each as one engine would give it: the prompt's text,
        prompt logprobs and cached tokens are the prefill worker's."""
        return [self._as_one_engine(out) for out in self.engine.step()]

    def _as_one_engine(self, out: RequestOutput) -> RequestOutput:
        h = self._live.get(out.request_id)
        if h is None:
            return out
        if self.found is not None:
            self.found[out.request_id] = out.num_cached_tokens  # this engine's, before the usage's
        out.prompt = h.prompt
        out.prompt_logprobs = h.prompt_logprobs
        out.num_cached_tokens = h.num_cached_tokens
        if out.finished:
            del self._live[out.request_id]
        return out


def run_disaggregated(prefill: PrefillWorker, decode: DecodeWorker,
                      requests: list[tuple]) -> dict[str, RequestOutput]:  # fmt: skip
    """Run `requests` ((request id, prompt, params, lora) each) through both workers, stepping
    them in turn on this thread; the final output of each. For tests and the offline API:
    servers run each worker in its own process (docs/disaggregation.md)."""
    for rid, prompt, params, lora in requests:
        prefill.add_request(rid, prompt, params, lora)
    done: dict[str, RequestOutput] = {}
    while prefill.has_unfinished() or decode.has_unfinished():
        for item in prefill.step() if prefill.has_unfinished() else []:
            if isinstance(item, Handoff):
                first = decode.add_handoff(item)
                if first is not None and first.finished:
                    done[first.request_id] = first
            else:
                done[item.request_id] = item
        if decode.has_unfinished():
            for out in decode.step():
                if out.finished:
                    done[out.request_id] = out
    return done
