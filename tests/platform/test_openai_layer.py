"""The OpenAI layer's typed answers (platform/openai/responses.py): documented as the routes'
responses, and written with the keys each kind of answer has always had. What the answers
hold is checked through the live server by the API tests (test_openai_compat.py and others)."""

from __future__ import annotations

import json

from loraplex.platform.db.session import upgrade
from loraplex.platform.main import create_app
from loraplex.platform.openai.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChoiceDelta,
    FunctionDelta,
    SampleDelta,
    ToolCallDelta,
    Usage,
)
from loraplex.platform.openai.streaming import Envelope, event
from loraplex.platform.settings import Settings


def test_the_routes_document_their_typed_answers(tmp_path):
    settings = Settings(data_dir=tmp_path, model=str(tmp_path / "no-model"), admin_key="k" * 32)
    upgrade(settings.database_url)
    paths = create_app(settings, load_model=False).openapi()["paths"]
    for path, method, model in [("/v1/completions", "post", "Completion"),
                                ("/v1/chat/completions", "post", "ChatCompletion"),
                                ("/v1/models", "get", "ModelList")]:  # fmt: skip
        content = paths[path][method]["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    assert (
        "text/event-stream" in paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    )


def test_chunks_leave_out_what_was_not_given_and_keep_explicit_nulls():
    env = Envelope("chatcmpl-1", "chat.completion.chunk", 7, "m")

    def chunk(delta, **usage) -> dict:
        choice = ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=None)
        text = event(ChatCompletionChunk(**env.fields(), choices=[choice], **usage))
        assert text.startswith("data: {") and text.endswith("}\n\n")
        return json.loads(text.removeprefix("data: "))

    call = ToolCallDelta(index=0, function=FunctionDelta(arguments='{"a"'))
    forced = chunk(ChoiceDelta(content=None, tool_calls=[call], role="assistant"))
    assert list(forced) == ["id", "object", "created", "model", "choices"]  # no usage asked
    assert forced["choices"][0] == {
        "index": 0, "logprobs": None, "finish_reason": None,
        "delta": {"content": None, "tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}],
                  "role": "assistant"},
    }  # fmt: skip
    # the first delta of n > 1 choices names the role first; a running usage has no details
    sample = chunk(SampleDelta(role="assistant", content="Hi"), usage=Usage(
        prompt_tokens=2, completion_tokens=1, total_tokens=3))  # fmt: skip
    assert list(sample["choices"][0]["delta"]) == ["role", "content"]
    assert sample["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert chunk(ChoiceDelta())["choices"][0]["delta"] == {}
