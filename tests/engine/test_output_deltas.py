"""The engine process's delta messages: what the server rebuilds is what the engine returned,
and a step message stays the same size however many tokens a request has produced."""

from __future__ import annotations

from loraplex.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.process.output_deltas import OutputDecoder, OutputEncoder, StepMessage


def _through_the_pipe(outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[int]]:
    """Each output encoded, sent as its own step message (JSON bytes), decoded."""
    encoder, decoder = OutputEncoder(), OutputDecoder()
    rebuilt, sizes = [], []
    for out in outputs:
        raw = StepMessage(outputs=[encoder.encode(out)]).to_json()
        sizes.append(len(raw))
        (delta,) = StepMessage.from_json(raw).outputs
        rebuilt.append(decoder.decode(delta))
    assert not encoder._sent and not decoder._outputs  # finished requests leave no state
    return rebuilt, sizes


def _engine_outputs(model: str, requests: list[tuple], abort_after: dict[str, int]):
    """Every output the engine returns, in order; `abort_after` aborts a request at a step."""
    engine = LLMEngine(EngineConfig(model, dtype="float32", seed=3))
    for rid, prompt, params, lora in requests:
        engine.add_request(rid, prompt, params, lora)
    outs, steps = [], 0
    while engine.has_unfinished():
        outs += engine.step()
        steps += 1
        for rid, at in abort_after.items():
            if steps == at and (out := engine.abort(rid)) is not None:
                outs.append(out)
    return outs


def test_rebuilt_outputs_equal_the_engines(tiny_models, tiny_adapters):
    model = str(tiny_models["llama"])
    lora = LoRARequest("qv4", 1, str(tiny_adapters["llama"]["qv4"]))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    # A stop string from the middle of what greedy writes: the text gets cut at the finish.
    (full,) = _engine_outputs(model, [("s", "Once upon", greedy, None)], {})[-1:]
    text = full.outputs[0].text
    stop = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[10:14]])
    requests = [
        ("plain", "Once upon", greedy, None),
        ("lora", "Once upon a time", greedy, lora),
        ("stop", "Once upon", stop, None),
        ("ids", [5, 17, 99, 3], SamplingParams(temperature=0.8, max_tokens=30, seed=1), None),
        ("aborted", "Numbers", greedy, None),
    ]
    outs = _engine_outputs(model, requests, {"aborted": 5})

    rebuilt, _ = _through_the_pipe(outs)
    assert rebuilt == outs
    last = {o.request_id: o for o in rebuilt}
    assert last["stop"].outputs[0].finish_reason == "stop"
    assert last["stop"].outputs[0].stop_reason == text[10:14]
    assert last["aborted"].outputs[0].finish_reason == "abort"
    assert last["lora"].lora_name == "qv4" and last["plain"].outputs[0].logprobs
    assert all(isinstance(t, int) for d in last["plain"].outputs[0].logprobs for t in d)


def test_a_cut_text_and_a_growing_one_are_rebuilt():
    def out(text: str, ids: list[int], finished: bool, reason: str | None = None):
        c = CompletionOutput(0, text, ids, reason, "wor" if reason else None, None, None)
        return RequestOutput("r", "p", [1], [c], finished, delta_token_ids=ids[-1:])

    outs = [out("hel", [7], False), out("hello wor", [7, 8], False)]
    outs.append(out("hello ", [7, 8, 9], True, "stop"))  # a stop string cut "wor…"
    rebuilt, _ = _through_the_pipe(outs)
    assert rebuilt == outs


def test_step_messages_do_not_grow_with_the_tokens_produced(tiny_models):
    params = SamplingParams(temperature=0, max_tokens=220, ignore_eos=True, logprobs=2)
    outs = _engine_outputs(str(tiny_models["llama"]), [("r", "Once", params, None)], {})
    assert len(outs) == 220
    rebuilt, sizes = _through_the_pipe(outs)
    assert rebuilt[-1] == outs[-1]
    # The sent digits of a logprob or of the cumulative sum vary a little; nothing else may.
    assert max(sizes[195:205]) <= max(sizes[5:15]) + 16, (sizes[5:15], sizes[195:205])
