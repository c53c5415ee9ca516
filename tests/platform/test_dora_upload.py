"""A DoRA adapter (peft's use_dora) through the real server: uploaded with POST /v1/adapters,
then served beside a plain LoRA adapter to the `openai` client; DoRA folders with a broken
magnitude vector are refused with a 422 that says why, and nothing is stored."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from testkit.dora import broken_dora_copy, make_dora_adapter
from tests.platform.test_upload_api import _refused, _snapshot
from tests.utils.server import run_server
from tests.utils.uploads import folder_parts, upload


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("dora-upl")) as srv:
        yield srv


@pytest.fixture(scope="module")
def dora(tiny_models, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dora-upl-adapter")
    targets = ("q_proj", "v_proj", "down_proj")
    return make_dora_adapter(tiny_models["llama"], root / "dora", targets=targets, seed=5)


def test_dora_upload_serves_beside_a_plain_adapter(server, dora, tiny_adapters):
    _, key = server.new_tenant("dora")
    response = upload(server.url, key, "shine", folder_parts(dora))
    assert response.status_code == 201, response.text
    assert sorted(response.json()["targets"]) == ["down_proj", "q_proj", "v_proj"]
    plain = upload(server.url, key, "plain", folder_parts(tiny_adapters["llama"]["qv4"]))
    assert plain.status_code == 201, plain.text

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)

    def text(model: str) -> str:
        out = client.completions.create(model=model, prompt="The quick brown", max_tokens=8,
                                        temperature=0)  # fmt: skip
        return out.choices[0].text

    shine, lora, base = text("shine"), text("plain"), text("llama")
    assert shine and shine not in (lora, base)


@pytest.mark.parametrize(("how", "words"), [("shape", ("lora_magnitude_vector", "expected")),
                                            ("nan", ("lora_magnitude_vector", "nan"))])  # fmt: skip
def test_broken_dora_upload_is_refused(how, words, server, dora, tmp_path):
    _, key = server.new_tenant(f"dora-{how}")
    before = _snapshot(server)
    folder = broken_dora_copy(dora, tmp_path / how, how)
    response = upload(server.url, key, f"bad-{how}", folder_parts(folder))
    _refused(server, response, before, 422, "invalid_adapter", *words)
