"""Grammar-constrained decoding (xgrammar): random tiny models still produce valid output."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.sampling.logits_processors import ProcessorContext, build_processors
from loraplex.engine.sampling.structured_output import GrammarProcessor, grammar_spec

PROMPTS = ["The quick brown fox", "Numbers like 1, 2, 3", "She said that", "A small engine"]
# Bounded everywhere, so a grammar forces the end long before max_tokens whatever the model says.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32", max_loras=4, max_lora_rank=16)


@pytest.fixture(scope="module")
def loras(tiny_adapters) -> list[LoRARequest | None]:
    named = tiny_adapters["llama"]
    return [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(named.items())]


def _params(spec: dict, **kw) -> SamplingParams:
    base = dict(temperature=0, max_tokens=120)
    return SamplingParams(**{**base, **kw}, logits_processors=[spec])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_holds_for_every_row_of_a_mixed_adapter_batch(llm, loras, temperature):
    spec = grammar_spec("json_schema", SCHEMA)
    prompts = [p for p in PROMPTS for _ in loras]
    adapters = [lr for _ in PROMPTS for lr in loras]
    params = [_params(spec, temperature=temperature, seed=i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, lora_request=adapters)
    texts = set()
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        texts.add(out.outputs[0].text)
    assert len(texts) > len(PROMPTS)  # the adapters and prompts still shape the content


@pytest.mark.parametrize(
    ("type_", "value", "check"),
    [
        ("regex", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"),
        ("choice", ["yes", "no", 'say "maybe"'], r'yes|no|say "maybe"'),
        ("ebnf", 'root ::= "(" [0-9] [0-9]? ")" ", " ("a" | "b")', r"\(\d\d?\), [ab]"),
    ],
)
def test_regex_choice_and_ebnf(llm, type_, value, check):
    spec = grammar_spec(type_, value)
    outs = llm.generate(PROMPTS, [_params(spec, temperature=1.0, seed=i) for i in range(4)])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(check, out.outputs[0].text), out.outputs[0].text


def test_unconstrained_rows_are_untouched_and_json_object_is_an_object(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], free)
    obj = _params(grammar_spec("json_object"), max_tokens=12)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[:2], [free, free, obj, obj])
    for a, m in zip(alone, mixed[:2], strict=True):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
    for m in mixed[2:]:
        # An unbounded grammar cut by max_tokens: finish_reason says so, the prefix is an object.
        text, reason = m.outputs[0].text, m.outputs[0].finish_reason
        assert text.startswith("{")
        assert reason == "length" or isinstance(json.loads(text), dict)


def test_a_length_cut_reports_length(llm):
    spec = grammar_spec("json_schema", {"type": "object", "properties": {"s": {"type": "string"}}})
    (out,) = llm.generate([PROMPTS[0]], _params(spec, max_tokens=3))
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text.startswith("{")


@pytest.mark.parametrize(
    ("type_", "value", "message"),
    [
        ("json_schema", {"type": "foo"}, 'invalid json_schema: Unsupported type "foo"'),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", ["a"], "must be a JSON object"),
        ("json_schema", {"properties": {"a": {"$ref": "#/nope"}}}, "nope"),
        ("regex", "([a-z]", "invalid regex"),
        ("choice", [], "non-empty list"),
        ("ebnf", "root ::= missing", 'Rule "missing" is not defined'),
        ("yaml", "x", "unknown grammar type 'yaml'"),
    ],
)
def test_bad_grammars_are_refused_naming_the_problem(type_, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        grammar_spec(type_, value)


def test_a_bad_spec_reaching_the_engine_queues_nothing(llm):
    bad = {"kind": "grammar", "type": "regex", "value": "(["}
    with pytest.raises(ValueError, match="invalid regex"):
        llm.engine.add_request("bad", [1, 5, 6], SamplingParams(logits_processors=[bad]))
    assert "bad" not in llm.engine.requests


def test_specs_cross_json_and_compile_once(llm):
    spec = grammar_spec("json_schema", SCHEMA)
    p = _params(spec)
    back = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p))))
    assert back.logits_processors == [spec]
    ctx = llm.engine.processor_context
    a = build_processors(back, ctx)[0]
    b = build_processors(p, ctx)[0]
    assert a.matcher is not b.matcher
    key = ("json_schema", json.dumps(SCHEMA, sort_keys=True))
    assert key in ctx.cache["xgrammar.compiled"]


def test_padded_logits_columns_are_masked_and_fork_rollback_keep_state(llm):
    # The logits may be wider than the tokenizer's vocabulary: those ids are never allowed.
    tok = llm.engine.tokenizer
    ctx = ProcessorContext(
        vocab_size=tok.vocab_size + 40, eos_token_ids=frozenset({2}), tokenizer=tok
    )
    (proc,) = build_processors(_params(grammar_spec("choice", ["ab"])), ctx)
    assert isinstance(proc, GrammarProcessor)
    logits = torch.zeros(3, ctx.vocab_size)
    GrammarProcessor.apply_batch(logits, [1], [proc])
    allowed = (logits[1] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and max(allowed) < tok.vocab_size
    assert all(tok.decode([t]) in ("a", "ab") for t in allowed)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()

    a = tok.token_to_id("a")
    proc.accept(a)
    twin = proc.fork()
    proc.rollback(1)
    logits = torch.zeros(1, ctx.vocab_size)
    GrammarProcessor.apply_batch(logits, [0], [twin])  # the twin still stands after "a"
    assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [tok.token_to_id("b")]
    logits = torch.zeros(1, ctx.vocab_size)
    GrammarProcessor.apply_batch(logits, [0], [proc])  # the original is back at the start
    assert a in (logits[0] > float("-inf")).nonzero().flatten().tolist()


def test_bounded_strings_refuse_raw_control_characters(llm):
    # xgrammar 0.2.9 lets them into strings with maxLength (its issue #800); strict JSON
    # parsers refuse them, so the grammar we compile must too.
    (proc,) = build_processors(
        _params(grammar_spec("json_schema", SCHEMA)), llm.engine.processor_context
    )
    assert proc.matcher.fork().accept_string('{"name": "ab')
    assert not proc.matcher.fork().accept_string('{"name": "a\tb')


def test_sparse_row_masking_matches_xgrammar_kernel():
    import xgrammar as xgr

    from loraplex.engine.sampling.structured_output import _mask_sparse_rows

    g = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's high bits lie past the logits
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, 32), dtype=torch.int32, generator=g)
    bitmask[1] = 0
    bitmask[1, 3] = 0b1011  # sparse rows: a few allowed tokens
    bitmask[4, :30] = 0
    bitmask[4, 31] = -1  # allowed ids past the vocabulary must be dropped
    bitmask[5] = -1
    logits = torch.randn(6, vocab, generator=g)
    rows = [0, 1, 4, 5]
    want, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows)
    dense = _mask_sparse_rows(got, bitmask, rows)
    assert dense == [0, 5]
    xgr.apply_token_bitmask_inplace(got, bitmask, vocab_size=vocab, indices=dense)
    assert torch.equal(got, want)
    assert (got[1] > float("-inf")).nonzero().flatten().tolist() == [96, 97, 99]
