"""A stopping engine stores its queued KV tier writes, within a bound (engine/memory/tiers
manager.py FLUSH_ON_CLOSE_S; docs/kv-tiers.md): what it stored, a new engine on the same disk
folder loads; what the bound cut off is dropped and counted, a miss later, never a wrong block.

The disk tier is the real one, held back by a gate (a store that stalls, as a slow or hung
shared store does) so that writes are surely queued when the engine stops."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.memory.tiers.manager import FLUSH_ON_CLOSE_S

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BLOCK = 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Gated:
    """The real store; its writes wait until the gate opens."""

    def __init__(self, store):
        self._store, self.gate, self.waiting = store, threading.Event(), threading.Event()

    def put(self, key, record):
        self.waiting.set()
        self.gate.wait()
        self._store.put(key, record)

    def __contains__(self, key):
        return key in self._store

    def __getattr__(self, name):
        return getattr(self._store, name)


def _llm(model, path, salt) -> LLM:
    return LLM(str(model), dtype="float32", block_size=BLOCK, max_model_len=256,
               max_lora_rank=16, kv_tier_disk_path=str(path), kv_tier_salt=salt)  # fmt: skip


def _gated_run(llm: LLM, prompt) -> _Gated:
    """One greedy request run to its end while the disk tier's writes are held back."""
    tiers = llm.engine.kv_tiers
    gated = _Gated(tiers.stores[0])
    tiers.stores[0] = gated
    engine = llm.engine
    engine.add_request(uuid.uuid4().hex, prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert gated.waiting.wait(10)  # the writer holds a batch: writes are queued
    return gated


def _computed_again(model, path, salt, prompt) -> int:
    """Prompt tokens a new engine on the same folder computes for `prompt`."""
    llm = _llm(model, path, salt)
    engine = llm.engine
    engine.add_request(uuid.uuid4().hex, prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    computed = engine.num_prompt_tokens_computed
    engine.close()
    return computed


def test_close_stores_the_queued_writes(tiny_models, tmp_path):
    model, salt = tiny_models["llama"], uuid.uuid4().hex
    prompt = torch.randint(5, 500, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = _llm(model, tmp_path / "kv", salt)
    gated = _gated_run(llm, prompt)
    threading.Timer(0.3, gated.gate.set).start()  # the store comes back while close waits
    assert llm.engine.kv_tiers.close() is True
    assert llm.engine.kv_tiers.dropped_writes == 0
    # Every full block the request computed (prompt and answer but the last token) ...
    written = (len(prompt) + GREEDY.max_tokens - 1) // BLOCK
    assert llm.engine.kv_tiers.counters["disk"].blocks_written == written
    # ... and a new engine loads the prompt's (all but its last token, which must be run).
    loaded = (len(prompt) - 1) // BLOCK
    assert _computed_again(model, tmp_path / "kv", salt, prompt) == len(prompt) - loaded * BLOCK


def test_close_gives_up_at_its_bound(tiny_models, tmp_path):
    """A store that never answers: close returns after its bound, the writes it could not
    store are dropped and counted, and a new engine computes the whole prompt."""
    model, salt = tiny_models["llama"], uuid.uuid4().hex
    prompt = torch.randint(5, 500, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    llm = _llm(model, tmp_path / "kv", salt)
    gated = _gated_run(llm, prompt)
    start = time.monotonic()
    assert llm.engine.kv_tiers.close(timeout=0.5) is False
    assert time.monotonic() - start < FLUSH_ON_CLOSE_S  # bounded, not the store's pace
    gated.gate.set()  # the held write now finds the close: it drops the rest of its batch
    llm.engine.kv_tiers._threads[1].join(10)
    tiers = llm.engine.kv_tiers
    written = tiers.counters["disk"].blocks_written
    assert tiers.dropped_writes + written == (len(prompt) + GREEDY.max_tokens - 1) // BLOCK
    assert tiers.dropped_writes > 0
    # The stored blocks are the chain's first ones at most: the rest is computed again.
    assert _computed_again(model, tmp_path / "kv", salt, prompt) >= len(prompt) - written * BLOCK


def test_the_server_engine_closes_its_tiers_on_shutdown(tiny_models, tmp_path):
    """AsyncLLMEngine.shutdown (the server's in-process engine) runs the tiers' close: the
    last request's blocks are on disk when it returns and the tier threads have stopped."""
    import asyncio

    from loraplex.engine import AsyncLLMEngine

    model, salt = tiny_models["llama"], uuid.uuid4().hex
    prompt = torch.randint(5, 500, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    llm = _llm(model, tmp_path / "kv", salt)
    server = AsyncLLMEngine(llm.engine)

    async def one() -> None:
        async for _ in server.generate(prompt, GREEDY):
            pass

    asyncio.run(one())
    server.shutdown()
    tiers = llm.engine.kv_tiers
    assert not any(t.is_alive() for t in tiers._threads)
    assert tiers.counters["disk"].blocks_written == (len(prompt) + GREEDY.max_tokens - 1) // BLOCK
