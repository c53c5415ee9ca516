"""Prefill and decode on different workers (issue 57; docs/disaggregation.md).

A prefill worker runs a request's prompt with its adapter, draws each sample's first token
and publishes the prompt's full KV blocks to the KV tiers (engine/memory/tiers); a `Handoff`
carries the first tokens and the sampling state to a decode worker, which loads the prefix
from the tier, computes only the prompt's tail and the first token, and continues the same
request: one request, one output stream.
"""

from loraplex.engine.disagg.handoff import FirstToken, Handoff
from loraplex.engine.disagg.resume import Resume
from loraplex.engine.disagg.workers import DecodeWorker, PrefillWorker, run_disaggregated

__all__ = [
    "DecodeWorker",
    "FirstToken",
    "Handoff",
    "PrefillWorker",
    "Resume",
    "run_disaggregated",
]
