"""Data planes the platform runs on: the embedded engine (default, platform/main.py) or a
vLLM fleet over its HTTP API (`vllm.py`), with adapters put in place by an agent
(`agent.py`: in-process on one host, or `loraplex agent` in each vLLM pod).

`make_vllm(state, model_dir)` builds the remote one from the settings:

    data_plane = "vllm"
    vllm_urls = "http://vllm-0:8000,http://vllm-1:8000"
    vllm_agent_urls = "http://vllm-0:8100,http://vllm-1:8100"   # or unset: in-process agents
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from sqlalchemy import select

from loraplex.engine import AdapterError, AdapterUnavailable, LoRARequest
from loraplex.platform.dataplane.agent import Agent
from loraplex.platform.dataplane.errors import DataPlaneUnavailable, Unsupported
from loraplex.platform.dataplane.vllm import Endpoint, VllmDataPlane

if TYPE_CHECKING:
    from loraplex.platform.state import AppState

__all__ = ["Agent", "DataPlaneUnavailable", "Unsupported", "VllmDataPlane", "make_vllm"]


def split_urls(value: str) -> list[str]:
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


def storage_key(state: AppState, digest: str) -> str:
    """The store key of an adapter with this content: the agent fetches by key."""
    from loraplex.platform.db.models import Adapter

    with state.sessions() as session:
        key = session.scalar(
            select(Adapter.storage_key).where(Adapter.sha256 == digest, Adapter.storage_key != "")
        )
    if key is None:
        raise AdapterUnavailable(f"no stored adapter has digest {digest[:12]}")
    return key


class RemoteAgent:
    """`loraplex agent` in a vLLM pod, over HTTP (platform/dataplane/agent_app.py)."""

    def __init__(self, url: str, timeout_s: float = 300.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        # One pooled client: a new one per call would build an SSL context on a request's path.
        self._http = httpx.Client(timeout=timeout_s)

    def ensure(self, name: str, key: str, digest: str) -> None:
        body = {"name": name, "key": key, "digest": digest}
        try:
            r = self._http.post(f"{self.url}/v1/ensure", json=body)
        except httpx.HTTPError as e:
            raise AdapterUnavailable(f"the adapter agent at {self.url} did not answer: {e}") from e
        if r.status_code == 422:
            raise AdapterError(r.json().get("detail", r.text))
        if r.status_code != 200:
            raise AdapterUnavailable(f"the adapter agent at {self.url} answered {r.status_code}")

    def close(self) -> None:
        self._http.close()


def make_vllm(state: AppState, model_dir: str | Path) -> VllmDataPlane:
    s = state.settings
    urls = split_urls(s.vllm_urls)
    agent_urls = split_urls(s.vllm_agent_urls)
    if agent_urls and len(agent_urls) != len(urls):
        raise ValueError(
            f"vllm_agent_urls has {len(agent_urls)} URLs for {len(urls)} vllm_urls: give one "
            "agent per vLLM server, in the same order, or none (agents in this process)"
        )
    root = s.vllm_adapter_dir or s.data_dir / "vllm-adapters"
    agents: dict[str, Agent | RemoteAgent] = {}
    for i, url in enumerate(urls):
        if agent_urls:
            agents[url] = RemoteAgent(agent_urls[i])
        else:  # one host: vLLM reads the adapters this process writes under `root`
            agents[url] = Agent(url, state.store, Path(root) / str(i),
                                max_adapters=s.vllm_max_adapters)  # fmt: skip

    def load(endpoint: Endpoint, name: str, lora: LoRARequest) -> None:
        digest = Path(lora.lora_path).name
        agents[endpoint.url].ensure(name, storage_key(state, digest), digest)

    plane = VllmDataPlane(urls, model_dir, load, window=s.vllm_window,
                          max_lora_rank=s.max_lora_rank)  # fmt: skip
    plane.agents = agents
    return plane
