"""The adapter agent: puts an adapter version where one vLLM server can read it, and loads it.

    data plane ── ensure(name, key, digest) ──▶ agent (in the vLLM pod, or in-process)
                                                 │ AdapterCache: store object → pod disk,
                                                 │   digest checked, LRU within max_bytes
                                                 ▼
                                vLLM  POST /v1/load_lora_adapter {lora_name, lora_path}

Each version is loaded under its own opaque name (`vllm_name`), so two tenants' adapters, or
two versions of one, never share a name inside vLLM (nor its prefix cache, which vLLM keys by
adapter). The agent keeps at most `max_adapters` names registered in its vLLM and unloads the
least recently used beyond that; the disk cache keeps what those names' paths point at.

`loraplex agent` serves `Agent.ensure` over HTTP beside a vLLM without a shared filesystem;
a single-host platform calls it in-process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path

import httpx

from loraplex.engine import AdapterError, AdapterUnavailable
from loraplex.platform.store import AdapterCache, AdapterStore

log = logging.getLogger("loraplex.agent")
NAME_PREFIX = "lpx-"


def vllm_name(lora_name: str, digest: str) -> str:
    """The name a version has inside vLLM: opaque (no tenant or adapter name leaks into vLLM's
    /v1/models or logs), and distinct per tenant, adapter and content."""
    return NAME_PREFIX + hashlib.sha256(f"{lora_name}\0{digest}".encode()).hexdigest()[:32]


def refusal(folder: Path) -> str | None:
    """Why vLLM cannot serve this PEFT adapter as loraplex's engine would, or None. Said before
    loading, so a tenant gets a clear 4xx naming the data plane, never a silent difference."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None  # vLLM's own load says what is wrong
    if config.get("use_dora"):
        return "DoRA adapters are not served by the vLLM data plane (vLLM has no DoRA)"
    if config.get("target_parameters"):
        return "expert-parameter adapters (target_parameters) are not served by the vLLM data plane"
    return None


class Agent:
    """Adapters for one vLLM server: fetched, checked, loaded, bounded. Thread-safe."""

    def __init__(
        self,
        vllm_url: str,
        store: AdapterStore,
        cache_dir: str | Path,
        *,
        max_bytes: int = 8 * 1024**3,
        max_adapters: int = 64,
        timeout_s: float = 120.0,
    ) -> None:
        self.url = vllm_url.rstrip("/")
        self.cache = AdapterCache(store, cache_dir, max_bytes=max_bytes)
        self.max_adapters = max_adapters
        self.timeout_s = timeout_s
        self._loaded: OrderedDict[str, str] = OrderedDict()  # vLLM name -> digest, LRU first
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self._http = httpx.Client(timeout=timeout_s)  # pooled: keep-alive to its vLLM

    def ensure(self, name: str, key: str, digest: str) -> None:
        """`name` is loaded in vLLM with the adapter stored under `key`. Raises AdapterError
        (the adapter cannot be served here) or AdapterUnavailable (store or vLLM trouble)."""
        # Asked only when vLLM does not list the name (a first use, or vLLM restarted): load
        # whatever this agent remembers; vLLM answers "already loaded" where it has it.
        with self._lock:
            one = self._loading.setdefault(name, threading.Lock())
        with one:
            try:
                with self.cache.use(key, digest) as folder:
                    if (why := refusal(folder)) is not None:
                        raise AdapterError(why)
                    self._load(name, folder)
            except (AdapterError, AdapterUnavailable):
                raise
            except Exception as e:  # store down, object gone, disk full
                raise AdapterUnavailable(f"adapter {digest[:12]} could not be fetched: {e}") from e
            with self._lock:
                self._loaded[name] = digest
                self._loaded.move_to_end(name)
                doomed = []
                while len(self._loaded) > self.max_adapters:
                    doomed.append(self._loaded.popitem(last=False)[0])
        for old in doomed:
            self.unload(old)

    def _load(self, name: str, folder: Path) -> None:
        r = self._post_load(name, folder, inplace=False)
        if r.status_code == 400 and "already been loaded" in r.text:
            with self._lock:
                ours = name in self._loaded
            if ours:
                return  # this agent loaded it from the folder it still keeps
            # Registered by an earlier life of this agent (or another one): the same content
            # (the name is its hash), but vLLM re-reads its path whenever it evicts the
            # adapter from its CPU cache, and that folder may be gone with the old agent's
            # cache. Point vLLM at this agent's copy, in place (`load_inplace`). Never used to
            # change a name's weights: vLLM 0.32 keeps the prefix cache computed with the old
            # ones (docs/peers.md); a new version gets a name of its own instead.
            r = self._post_load(name, folder, inplace=True)
        if r.status_code >= 500 or r.status_code == 404:
            # 404: vLLM runs without VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
            raise AdapterUnavailable(f"vLLM at {self.url} answered {r.status_code}: {r.text}")
        if r.status_code != 200:
            raise AdapterError(f"the vLLM data plane refused the adapter: {_message(r)}")

    def _post_load(self, name: str, folder: Path, *, inplace: bool) -> httpx.Response:
        body = {"lora_name": name, "lora_path": str(folder), "load_inplace": inplace}
        try:
            return self._http.post(f"{self.url}/v1/load_lora_adapter", json=body)
        except httpx.HTTPError as e:
            raise AdapterUnavailable(f"vLLM at {self.url} did not load the adapter: {e}") from e

    def unload(self, name: str) -> None:
        with self._lock:
            self._loaded.pop(name, None)
        try:
            self._http.post(f"{self.url}/v1/unload_lora_adapter", json={"lora_name": name})
        except httpx.HTTPError as e:  # it stays registered: harmless, next eviction retries
            log.warning("vLLM at %s did not unload %s: %s", self.url, name, e)

    def forget(self) -> None:
        """vLLM restarted: it has none of our adapters any more."""
        with self._lock:
            self._loaded.clear()

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def close(self) -> None:
        self._http.close()
        self.cache.close()


def _message(r: httpx.Response) -> str:
    try:
        error = r.json().get("error", {})
        return error.get("message") if isinstance(error, dict) else str(error)
    except ValueError:
        return r.text[:500]
