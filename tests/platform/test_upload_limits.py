"""The last upload holes of issue 62, and a poisoned adapter served beside other tenants.

Refused with a 4xx and a code, leaving nothing stored: `layers_to_transform` / `layers_pattern`
naming layers the model does not have, JSON nested 100,000 deep (an adapter_config.json, a
safetensors header, a request body), a request body past the size limit, and weights beyond
the magnitude bound (finite but absurd, or an absurd lora_alpha). A server whose bound is
raised serves such an adapter: its requests end with 422 invalid_adapter (a stream with an
error event), never a 500, and the other tenant's greedy outputs and logprobs in the same
batches equal those it gets alone.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.platform.openai.bodies import MAX_JSON_BODY_BYTES, MAX_JSON_DEPTH, json_depth
from testkit.factories import make_adapter
from tests.utils.server import run_server, upload_adapter
from tests.utils.uploads import auth, folder_parts, upload

DEEP = 100_000


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("limits")) as srv:
        yield srv


@pytest.fixture(scope="module")
def good(tiny_adapters) -> Path:
    return tiny_adapters["llama"]["all2"]


@pytest.fixture(scope="module")
def tenant(server) -> str:
    return server.new_tenant("limits")[1]


def _variant(good: Path, root: Path, name: str, *, config: dict | bytes | None = None,
             weights=None, raw_weights: bytes | None = None) -> Path:  # fmt: skip
    """`good` with its config fields updated (or replaced by raw bytes) and its weights
    changed by `weights(name, tensor)`, or replaced by a raw safetensors file."""
    folder = root / name
    folder.mkdir(parents=True)
    cfg = json.loads((good / "adapter_config.json").read_text())
    text = config if isinstance(config, bytes) else json.dumps({**cfg, **(config or {})})
    (folder / "adapter_config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    if raw_weights is not None:
        (folder / "adapter_model.safetensors").write_bytes(raw_weights)
    else:
        tensors = load_file(good / "adapter_model.safetensors")
        change = weights or (lambda _, t: t)
        save_file({k: change(k, t) for k, t in tensors.items()},
                  folder / "adapter_model.safetensors")  # fmt: skip
    return folder


def _deep_header(good: Path) -> bytes:
    """A safetensors file whose header's __metadata__ nests DEEP arrays (valid otherwise)."""
    data = (good / "adapter_model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = {"x": "PLACEHOLDER"}
    text = json.dumps(header).replace('"PLACEHOLDER"', "[" * DEEP + "]" * DEEP).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def _one_huge(name: str, t: torch.Tensor) -> torch.Tensor:
    if "lora_B" not in name or ".0.self_attn.v_proj" not in name:
        return t
    out = t.clone()
    out[0, 0] = 1e30
    return out


CASES = {
    # case -> (variant kwargs, status, code, words the message holds)
    "layer_past_the_last": (dict(config={"layers_to_transform": [999]}), 422, "bad_layers",
                            "999", "0 to 1"),
    "negative_layer": (dict(config={"layers_to_transform": [-1]}), 422, "bad_layers", "-1"),
    "one_layer_index": (dict(config={"layers_to_transform": 5}), 422, "bad_layers", "5"),
    "bool_layer": (dict(config={"layers_to_transform": [True]}), 422, "bad_layers", "index"),
    "foreign_layer_list": (dict(config={"layers_to_transform": [0], "layers_pattern": "h"}),
                           422, "bad_layers", "'h'", "model.layers"),
    "weights_outside_listed_layers": (dict(config={"layers_to_transform": [0]}), 422,
                                      "invalid_adapter", "layer 1", "layers_to_transform"),
    "deep_config": (dict(config=b'{"r": ' + b"[" * DEEP + b"]" * DEEP + b"}"), 422,
                    "json_too_deep", "adapter_config.json", str(DEEP + 1)),
    "all_weights_1e30": (dict(weights=lambda _, t: torch.full_like(t, 1e30)), 422,
                         "weights_too_large", "1e+30"),
    "one_huge_weight": (dict(weights=_one_huge), 422, "weights_too_large", "v_proj"),
    "absurd_alpha": (dict(config={"lora_alpha": 1e12}), 422, "weights_too_large", "lora_alpha"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES) + ["deep_safetensors_header"])
def test_refused_with_a_code_and_nothing_stored(server, tenant, good, tmp_path, case):
    if case == "deep_safetensors_header":
        kwargs, status, code, *words = dict(raw_weights=_deep_header(good)), 422, "json_too_deep"
        words = ["adapter_model.safetensors", str(DEEP + 2)]
    else:
        kwargs, status, code, *words = CASES[case]
    folder = _variant(good, tmp_path, case, **kwargs)
    r = upload(server.url, tenant, case.replace("_", "-"), folder_parts(folder))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    for word in words:
        assert word in error["message"], error["message"]
    listed = httpx.get(f"{server.url}/v1/adapters", headers=auth(tenant), timeout=30).json()
    assert case.replace("_", "-") not in json.dumps(listed)
    assert not list((server.settings.data_dir / "tmp").rglob("*.safetensors"))


def test_layers_to_transform_within_the_model_uploads(server, tenant, good, tmp_path):
    folder = _variant(good, tmp_path, "listed", config={"layers_to_transform": [0, 1],
                                                         "layers_pattern": "layers"})  # fmt: skip
    assert upload(server.url, tenant, "listed", folder_parts(folder)).status_code == 201


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/admin/api/tenants"])
def test_a_deeply_nested_body_is_a_400(server, tenant, path):
    body = b'{"model": "x", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    r = httpx.post(f"{server.url}{path}", content=body, timeout=30,
                   headers={**auth(tenant), "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "json_too_deep"
    # as deep as allowed is read (and answered for what it is: not a valid prompt)
    ok = b'{"model": "x", "prompt": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)
    r = httpx.post(f"{server.url}/v1/completions", content=ok + b"}", timeout=30,
                   headers={**auth(tenant), "content-type": "application/json"})  # fmt: skip
    assert r.status_code != 500 and r.json()["error"]["code"] != "json_too_deep"


def test_a_body_past_the_size_limit_is_a_413(server, tenant):
    body = b'{"model": "x", "prompt": "' + b"a" * MAX_JSON_BODY_BYTES + b'"}'
    r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                   headers={**auth(tenant), "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"


def test_json_depth_counts_brackets_outside_strings():
    assert json_depth(b'{"a": [1, {"b": "[[[\\" ]]"}], "c": {}}') == 3
    assert json_depth(b"[]") == 1 and json_depth(b'"[[["') == 0
    assert json_depth(b"[" * DEEP + b"]" * DEEP) == DEEP


def test_a_poisoned_adapter_answers_for_itself(server, tiny_models, tmp_path):
    """The held case: tenant A's adapter has every weight at 1e30 (accepted while the bound is
    raised); concurrent requests from A, tenant B's adapter and the base share batches. A's
    requests get 422 invalid_adapter or a stream's error event, never a 500; B's and the
    base's text equals what they get alone, and their logprobs too, up to the rounding a
    different batch makes (bit-identity under the same batch shapes: tests/engine/
    test_row_isolation.py)."""
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")
    normal = make_adapter(tiny_models["llama"], tmp_path / "b", r=8, alpha=16, seed=7,
                          targets=targets)  # fmt: skip
    poison = _variant(normal, tmp_path, "poison", weights=lambda _, t: torch.full_like(t, 1e30))
    key_a, key_b = server.new_tenant("tenant-a")[1], server.new_tenant("tenant-b")[1]
    bound, server.settings.max_adapter_weight = server.settings.max_adapter_weight, 1e38
    try:
        assert upload_adapter(server.url, key_a, "wild", poison).status_code == 201
    finally:
        server.settings.max_adapter_weight = bound
    assert upload_adapter(server.url, key_b, "tame", normal).status_code == 201

    def ask(key: str, model: str, stream: bool = False) -> httpx.Response:
        body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 6,
                "temperature": 0, "logprobs": 1, "stream": stream}  # fmt: skip
        return httpx.post(f"{server.url}/v1/completions", headers=auth(key), json=body,
                          timeout=120)  # fmt: skip

    models = httpx.get(f"{server.url}/v1/models", headers=auth(key_b), timeout=30).json()
    base = next(m["id"] for m in models["data"] if m["id"] != "tame")
    alone = {m: ask(key_b, m).json()["choices"][0] for m in ("tame", base)}
    mix = [(key_a, "wild", False), (key_b, "tame", False), (key_b, base, False),
           (key_a, "wild", True), (key_b, "tame", False), (key_a, "wild", False)]  # fmt: skip
    with ThreadPoolExecutor(len(mix)) as pool:
        answers = list(pool.map(lambda a: ask(*a), mix))
    for (_, model, stream), r in zip(mix, answers, strict=True):
        if model == "wild" and r.status_code != 200:  # ended before a stream started
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == "invalid_adapter"
            assert "non-finite" in r.json()["error"]["message"]
        elif model == "wild":
            assert stream and '"code": "invalid_adapter"' in r.text, r.text
        else:
            assert r.status_code == 200, r.text
            got, want = r.json()["choices"][0], alone[model]
            assert got["text"] == want["text"]
            lp, want_lp = got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
            assert lp == pytest.approx(want_lp, abs=1e-5)
