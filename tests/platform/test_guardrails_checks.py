"""The deterministic checks and the output filter's window, without a server: PII found (and
look-alikes not), terms and patterns, and a term split over many stream deltas never sent."""

from __future__ import annotations

import asyncio

from loraplex.engine import CompletionOutput, RequestOutput
from loraplex.platform.guardrails.checks import Checks, check_rules, redact
from loraplex.platform.guardrails.gate import Gate, Policy
from loraplex.platform.guardrails.stream import HOLDBACK, STRIDE, OutputFilter


def rules(text: str, **kw) -> list[tuple[str, str]]:
    checks = Checks.build(kw.get("terms", []), kw.get("patterns", []), kw.get("pii", []))
    return [(h.rule, text[h.start : h.end]) for h in checks.scan(text)]


def test_pii_kinds_and_their_look_alikes():
    pii = ["email", "phone", "card"]
    text = ("write to ann.lee+x@mail.example.org or call +1 415-555-2671; "
            "card 4111-1111-1111-1111")  # fmt: skip
    assert rules(text, pii=pii) == [
        ("pii:email", "ann.lee+x@mail.example.org"),
        ("pii:phone", "+1 415-555-2671"),
        ("pii:card", "4111-1111-1111-1111"),
    ]
    # A card number whose check digit fails, an address without a domain, a short number.
    assert rules("4111 1111 1111 1112, ann@localhost, call 555-26", pii=pii) == []


def test_terms_ignore_case_and_patterns_are_as_written():
    got = rules("Project FALCON and project falcon; ID-42 id-7",
                terms=["project falcon"], patterns=[r"ID-\d+"])  # fmt: skip
    assert got == [("term", "Project FALCON"), ("term", "project falcon"), ("regex:0", "ID-42")]
    assert check_rules([], ["("], []) is not None and check_rules([], [], ["ssn"]) is not None
    assert redact("a secret b secret", [(2, 8), (4, 10), (11, 17)]) == "a [REDACTED] [REDACTED]"


class Recording(Gate):
    def __init__(self, policies) -> None:
        super().__init__(None, None, "completions", policies)
        self.recorded = []
        self.windows = []  # each judged output window

    async def evaluate(self, stage, text, start=0, new_from=0):
        self.windows.append(text)
        return await super().evaluate(stage, text, start, new_from)

    async def record(self, request_id, events) -> None:
        self.recorded += events


class Job:
    request_id = "cmpl-1"
    finish_reason = None


def outputs(pieces: list[str]):
    """One engine output per piece, a token each (ids 0, 1, ...), the last finished."""

    async def gen():
        text, ids = "", []
        for i, piece in enumerate(pieces):
            text, ids = text + piece, [*ids, i]
            last = i == len(pieces) - 1
            c = CompletionOutput(0, text, list(ids), "length" if last else None)
            yield RequestOutput("r", None, [1], [c], last, delta_text=piece, delta_token_ids=[i],
                                num_generated_tokens=len(ids))  # fmt: skip

    return gen()


def run_filter(policy: Policy, pieces: list[str]):
    gate = Recording([policy])
    filt = OutputFilter(gate, Job())

    async def collect():
        return [out async for out in filt(outputs(pieces))]

    return asyncio.run(collect()), gate


def policy(action: str, terms: list[str]) -> Policy:
    return Policy(1, "p", "output", action, Checks.build(terms, [], []), None, "closed", False)


def test_a_term_split_over_deltas_is_never_sent_and_only_sent_tokens_count():
    pieces = ["the quick brown fox ", "jumps over the lazy dog ", "and then ", "for", "bid",
              "den", " words follow here and more"]  # fmt: skip
    outs, gate = run_filter(policy("block", ["forbidden"]), pieces)
    sent = "".join(o.delta_text for o in outs)
    assert sent == "the quick brown fox jumps over the lazy dog and then "
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "content_filter"
    assert sum(len(o.delta_token_ids) for o in outs) == 3 == outs[-1].num_generated_tokens
    assert [(e.rule, e.action) for e in gate.recorded] == [("term", "block")]


def test_redaction_while_streaming_equals_redacting_the_whole():
    pieces = ["a" * 10, " secret ", "b" * 40, " sec", "ret", "c" * 40, " end"]
    outs, gate = run_filter(policy("redact", ["secret"]), pieces)
    sent = "".join(o.delta_text for o in outs)
    whole = "".join(pieces)
    assert sent == whole.replace("secret", "[REDACTED]")
    assert "secret" not in sent and sent.count("[REDACTED]") == 2
    assert outs[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.delta_token_ids) for o in outs) == len(pieces)  # every token sent
    assert len(gate.recorded) == 2  # each hit recorded once, however often it was in a window
    # Until the end, the newest HOLDBACK characters were always still held.
    held = [len("".join(pieces[: i + 1])) - len("".join(o.delta_text for o in outs[: i + 1]))
            for i in range(len(outs) - 1)]  # fmt: skip
    assert all(h > 0 for h in held) and max(held) >= HOLDBACK


def test_the_first_text_leaves_with_the_first_token_past_the_holdback():
    # One character a token: no judgement while everything held is HOLDBACK or fewer
    # characters (it could release nothing), then one every STRIDE characters and at the end.
    pieces = list("abcdefghij" * 10)
    outs, gate = run_filter(policy("flag", ["zzz"]), pieces)
    first = next(i for i, o in enumerate(outs) if o.delta_text)
    assert first == HOLDBACK  # the token that makes HOLDBACK + 1 characters held
    assert "".join(o.delta_text for o in outs) == "".join(pieces)
    starts = [HOLDBACK + 1 + k * STRIDE for k in range(6) if HOLDBACK + 1 + k * STRIDE < 100]
    assert [len(w) for w in gate.windows] == [*starts, 100]
