"""A decode worker takes a request up after its first tokens (LLMEngine.add_request's
`resume`).

Each sample starts with the token the prefill worker drew, as if this engine had drawn it:
it is the sample's first output token (penalties, min_tokens and max_tokens count it), its
logprobs are kept, a seeded sample's generator goes on from the state after that draw, and
its logits processors (structured output) take it in. The stop checks then run over it here,
so the text streamed, what a stop string holds back and the finish reasons are the ones a
single engine would give. Each sample is scheduled on its own (no fork: each already has its
token); the prompt's blocks come from the KV tiers or the device prefix cache, so only the
prompt's tail and the first token are computed before the next token is drawn.
"""

from __future__ import annotations

import time

import torch

from loraplex.engine.disagg.handoff import Handoff


class Resume:
    def __init__(self, handoff: Handoff):
        self.handoff = handoff
        self.output = None  # set by start: the request's output after its first tokens

    def start(self, engine, group) -> None:
        """Queue `group`'s samples after their first tokens (the engine's add_request)."""
        h = self.handoff
        if len(h.samples) != len(group.samples):
            raise ValueError(
                f"the handoff has {len(h.samples)} samples; the request draws {len(group.samples)}"
            )
        now = time.time()
        device = engine.model.device
        for sample, first in zip(group.samples, h.samples, strict=True):
            seq = sample.seq
            seq.output_token_ids = [first.token]
            if first.logprob is not None and (seq.params.logprobs is not None
                                              or seq.params.best_of):  # fmt: skip
                seq.logprobs = [first.logprob]
                seq.top_logprobs = [list(first.top)]
            if first.generator_state is not None:
                g = torch.Generator(device=device)
                g.set_state(torch.frombuffer(bytearray(first.generator_state), dtype=torch.uint8))
                seq.generator = g
            for proc in seq.processors:
                proc.accept(first.token)
            seq.arrival_time = h.arrival_time or seq.arrival_time
            seq.first_token_time = h.first_token_time or now
            seq.last_token_time = now
            engine.scheduler.add(seq)
        for sample in group.samples:  # the stop checks over the first token, as one engine
            stop = engine.outputs.check_stop(sample)
            if stop is not None:
                engine._finish(sample, stop.reason, stop.stop_reason)
        # The first token's output (its text, what a stop string holds back), for the caller
        # to deliver now: nothing of it waits for a step.
        self.output = engine._output(group)
