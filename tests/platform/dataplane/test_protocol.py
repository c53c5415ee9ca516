"""The vLLM data plane's wire format and routing, without a vLLM: requests as vLLM takes them,
its chunks back as the engine's outputs (token ids, deltas, n > 1, usage), refusals by name,
and requests sent where their adapter is already loaded."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine import SamplingParams
from loraplex.platform.dataplane import DataPlaneUnavailable, Unsupported
from loraplex.platform.dataplane.protocol import Assembler, metric, request_body
from loraplex.platform.dataplane.vllm import VllmDataPlane, sse_lines


def test_request_body_carries_the_sampling_and_asks_for_ids_and_usage():
    params = SamplingParams(max_tokens=5, temperature=0.0, top_k=0, stop="\n", seed=7,
                            logit_bias={3: -1.0})  # fmt: skip
    body = request_body("lpx-x", [1, 2, 3], params, priority=1)
    assert body["prompt"] == [1, 2, 3] and body["model"] == "lpx-x"
    assert body["return_token_ids"] and body["stream_options"]["continuous_usage_stats"]
    assert body["top_k"] == -1 and body["stop"] == ["\n"] and body["seed"] == 7
    assert body["logit_bias"] == {"3": -1.0}
    assert body["priority"] > 0  # batch lines after interactive ones
    assert "priority" not in request_body("m", [1], params, priority=0)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(n=1, best_of=3), "best_of"),  # vLLM 0.32 has no best_of
        (SamplingParams(n=2, temperature=0.0), "n"),  # vLLM refuses it
        (SamplingParams(logits_processors=[{"kind": "grammar", "type": "json_object"},
                                           {"kind": "grammar", "type": "json_object"}]),
         "response_format"),
    ],
)  # fmt: skip
def test_what_vllm_cannot_do_is_refused_by_name(params, param):
    with pytest.raises(Unsupported) as e:
        request_body("m", [1], params, priority=0)
    assert e.value.param == param and "vllm data plane" in str(e.value)


def test_logprobs_and_grammars_go_through_as_vllm_spells_them():
    body = request_body("m", [1], SamplingParams(logprobs=3), priority=0)
    assert body["logprobs"] == 3 and body["return_tokens_as_token_ids"] and body["stream"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammars = {
        "json_schema": (schema, {"json": schema}),
        "json_object": (None, {"json": {"type": "object"}}),
        "regex": ("[a-z]+", {"regex": "[a-z]+"}),
        "choice": (["yes", "no"], {"choice": ["yes", "no"]}),
        "ebnf": ('root ::= "a"', {"grammar": 'root ::= "a"'}),
    }
    for kind, (value, wanted) in grammars.items():
        spec = {"kind": "grammar", "type": kind, "value": value}
        body = request_body("m", [1], SamplingParams(logits_processors=[spec]), priority=0)
        assert body["structured_outputs"] == wanted, kind
    # vLLM scores a prompt only without stream; max_tokens 0 makes one token, dropped later
    body = request_body("m", [1], SamplingParams(prompt_logprobs=2, max_tokens=0), priority=0)
    assert not body["stream"] and "stream_options" not in body
    assert body["prompt_logprobs"] == 2 and body["max_tokens"] == 1


def lps(*tokens: tuple[int, float, dict[int, float]]) -> dict:
    return {"tokens": [f"token_id:{t}" for t, _, _ in tokens],
            "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": [{f"token_id:{k}": v for k, v in top.items()} for _, _, top in tokens],
            "text_offset": [0] * len(tokens)}  # fmt: skip


def test_logprobs_come_back_by_token_id_chosen_first():
    asm = Assembler("r", [1, 2], SamplingParams(logprobs=2), None)
    c = chunk(0, "x", [7], completion=1)
    c["choices"][0]["logprobs"] = lps((7, -1.5, {4: -0.5, 7: -1.5, 9: -2.0}))
    out = asm.add(c)
    c = chunk(0, "y", [4], finish="length", completion=2)
    c["choices"][0]["logprobs"] = lps((4, -0.25, {4: -0.25, 3: -3.0}))
    out = asm.add(c)
    (choice,) = out.outputs
    assert [list(e.items()) for e in choice.logprobs] == [
        [(7, -1.5), (4, -0.5), (9, -2.0)],
        [(4, -0.25), (3, -3.0)],
    ]
    assert choice.cumulative_logprob == pytest.approx(-1.75)


def test_prompt_logprobs_from_a_whole_answer_and_max_tokens_zero():
    params = SamplingParams(prompt_logprobs=1, max_tokens=0)
    asm = Assembler("r", [5, 6, 7], params, None)
    answer = {
        "choices": [{"index": 0, "text": "z", "token_ids": [8], "finish_reason": "length",
                     "prompt_logprobs": [
                         None,
                         {"6": {"logprob": -2.0, "rank": 3}, "1": {"logprob": -0.1, "rank": 1}},
                         {"7": {"logprob": -0.3, "rank": 1}},
                     ]}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }  # fmt: skip
    out = asm.add(answer)
    assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert out.num_generated_tokens == 0  # vLLM's one token was never asked for
    scored = out.prompt_logprobs
    assert scored.token_logprobs == [None, -2.0, -0.3] and scored.ranks == [None, 3, 1]
    assert scored.top == [None, [(1, -0.1)], [(7, -0.3)]]


def chunk(index: int, text: str, ids: list[int], finish=None, completion=None) -> dict:
    usage = {"prompt_tokens": 3, "completion_tokens": completion} if completion else None
    return {"choices": [{"index": index, "text": text, "token_ids": ids,
                         "finish_reason": finish}], "usage": usage}  # fmt: skip


def test_chunks_become_outputs_with_deltas_for_each_choice():
    asm = Assembler("r1", [1, 2, 3], SamplingParams(n=2), lora_name="t/a@v1")
    first = asm.add(chunk(0, "He", [10], completion=1))
    assert (first.delta_text, first.delta_token_ids, first.finished) == ("He", [10], False)
    # vLLM's continuous usage counts the chunk's own choice (n > 1)
    assert asm.add(chunk(1, "Yo", [20], completion=1)).num_generated_tokens == 2
    asm.add(chunk(0, "llo", [11], finish="length", completion=2))
    last = asm.add(chunk(1, "!", [21], finish="stop", completion=2))
    assert last.finished and last.num_generated_tokens == 4
    assert [(c.text, c.token_ids, c.finish_reason) for c in last.outputs] == [
        ("Hello", [10, 11], "length"),
        ("Yo!", [20, 21], "stop"),
    ]
    assert first.outputs[0].token_ids == [10]  # an output handed out earlier does not change
    assert asm.add({"choices": [], "usage": {"completion_tokens": 4}}) is None
    with pytest.raises(DataPlaneUnavailable):
        asm.add({"error": {"message": "engine dead"}})


def test_metric_sums_every_label_set():
    text = 'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 3.0\n'
    text += "vllm:num_requests_running_total 9\n# HELP vllm:num_requests_running x\n"
    assert metric(text, "vllm:num_requests_running") == 5.0


def test_requests_go_where_their_adapter_is_loaded(plane_model):
    plane = VllmDataPlane(["http://a:8000", "http://b:8000", "http://c:8000"], plane_model,
                          loader=lambda *_: None)  # fmt: skip
    a, b, c = plane.endpoints
    with pytest.raises(DataPlaneUnavailable):
        plane._route("lpx-1")  # none answers yet
    a.healthy = b.healthy = True
    c.loaded = {"lpx-1"}  # c has it but does not answer: never chosen
    b.loaded = {"lpx-1"}
    assert plane._route("lpx-1") is b
    assert plane._route("lpx-2") in (a, b)
    assert plane.unavailable() is None
    a.healthy = b.healthy = False
    assert "no vLLM endpoint" in plane.unavailable()


def test_sse_lines_of_any_length_in_any_pieces():
    """vLLM's first chunk holds the prompt's ids: a line far over aiohttp's line limit."""
    long = b"data: " + b"1," * 300_000
    stream = b"data: a\n\n" + long + b"\n\ndata: [DONE]\n\n"

    async def pieces():
        for i in range(0, len(stream), 7_000):
            yield stream[i : i + 7_000]

    async def lines():
        return [line async for line in sse_lines(pieces())]

    assert [x for x in asyncio.run(lines()) if x] == [b"data: a", long, b"data: [DONE]"]
