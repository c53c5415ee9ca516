"""BlockManager: paged allocation, reference counts and the adapter/tenant-keyed prefix cache.

Sequences are built by hand; "computing" tokens means advancing `num_computed_tokens` and
calling `cache_full_blocks`, as the scheduler's postprocess does.
"""

from __future__ import annotations

import random

import pytest

from loraplex.engine.memory.block_manager import BlockManager
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import LoRARequest, Sequence

BS = 4
LORA_A = LoRARequest("a", 1, "/nowhere/a")
LORA_B = LoRARequest("b", 2, "/nowhere/b")


def make_seq(
    tokens: list[int], lora: LoRARequest | None = None, tenant: str | None = None
) -> Sequence:
    return Sequence("req", list(tokens), SamplingParams(), lora=lora, tenant=tenant)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` the way the scheduler does; returns the number of cached prompt tokens."""
    hits, num_cached = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - num_cached, hits)
    seq.num_computed_tokens = num_cached
    return num_cached


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def slots(seq: Sequence, bs: int = BS) -> list[int]:
    """Where each token position's KV lives (the model runner's slot mapping)."""
    return [seq.block_table[p // bs] * bs + p % bs for p in range(seq.num_tokens)]


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


# ---------------------------------------------------------------------------- allocation
def test_allocation_grows_block_table_and_slots_never_overlap():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(range(10, 20)), make_seq(range(30, 35))
    assert bm.allocate_slots(a, 10)
    assert len(a.block_table) == 3  # ceil(10 / 4)
    assert bm.allocate_slots(b, 5)
    assert len(b.block_table) == 2
    assert bm.num_free_blocks == 3

    # A decode that still fits the last block takes no new block; the next one does.
    compute_all(bm, a)
    a.output_token_ids += [7, 8]  # 12 tokens: block 3 is full now
    assert bm.allocate_slots(a, 2)
    assert len(a.block_table) == 3
    a.num_computed_tokens = 12
    a.output_token_ids.append(9)
    assert bm.allocate_slots(a, 1)
    assert len(a.block_table) == 4
    assert bm.num_free_blocks == 2

    # Every token of both sequences has its own slot inside the pool.
    all_slots = slots(a) + slots(b)
    assert len(set(all_slots)) == len(all_slots)
    assert all(0 <= s < bm.num_blocks * BS for s in all_slots)
    assert [s % BS for s in slots(a)] == [p % BS for p in range(a.num_tokens)]
    assert ref_counts(bm).count(1) == 6 and ref_counts(bm).count(0) == 2


def test_allocate_refuses_when_pool_is_short_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(12))
    assert bm.allocate_slots(a, 12)  # 3 of 4 blocks
    b = make_seq(range(100, 108))
    before = (list(bm.free_queue), ref_counts(bm), dict(bm.cached))
    assert bm.allocate_slots(b, 8) is False
    assert b.block_table == []
    assert (list(bm.free_queue), ref_counts(bm), dict(bm.cached)) == before
    assert bm.allocate_slots(b, 4)  # one block is still there for a smaller request


def test_refusal_with_cache_hits_does_not_revive_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(9))
    a = make_seq(prompt)
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)  # its two full blocks stay cached, ref 0, in the free queue
    filler = make_seq(range(200, 208))
    assert bm.allocate_slots(filler, 8)  # the never-used block and a's partial tail
    b = make_seq(prompt + [50] * 8)  # 2 hits + 9 new tokens -> 3 more blocks
    hits, num_cached = bm.get_computed_blocks(b)
    assert num_cached == 8
    before = (list(bm.free_queue), ref_counts(bm), dict(bm.cached))
    assert bm.allocate_slots(b, b.num_tokens - num_cached, hits) is False
    assert b.block_table == []
    assert (list(bm.free_queue), ref_counts(bm), dict(bm.cached)) == before


def test_free_returns_every_block():
    bm = BlockManager(num_blocks=10, block_size=BS)
    seqs = [make_seq(range(i * 50, i * 50 + n)) for i, n in enumerate((3, 9, 13))]
    for s in seqs:
        admit(bm, s)
        compute_all(bm, s)
    assert bm.num_free_blocks == 10 - (1 + 3 + 4)
    for s in seqs:
        bm.free(s)
        assert s.block_table == []
    assert bm.num_free_blocks == bm.num_blocks
    assert set(ref_counts(bm)) == {0}
    bm.check_all_free()


# ---------------------------------------------------------------------------- prefix cache
def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    admit(bm, a)
    bm.cache_full_blocks(a)
    assert bm.cached == {}, "nothing is computed yet"
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    assert list(bm.cached.values()) == a.block_table[:1]
    compute_all(bm, a)
    assert sorted(bm.cached.values()) == sorted(a.block_table[:2])  # not the partial third


def test_same_prefix_shares_blocks_with_ref_count_two():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(100, 110))
    a = make_seq(prompt)
    admit(bm, a)
    compute_all(bm, a)
    b = make_seq(prompt[:8] + [1, 2, 3])
    hits, num_cached = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2] and num_cached == 8
    assert bm.allocate_slots(b, b.num_tokens - num_cached, hits)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1]
    # Freeing one sharer keeps the blocks held by the other.
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.free(b)
    bm.check_all_free()


@pytest.mark.parametrize(("prompt_len", "expected_hits"), [(8, 1), (9, 2), (12, 2), (13, 3)])
def test_hits_leave_at_least_one_token_to_compute(prompt_len, expected_hits):
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(300, 300 + prompt_len))
    a = make_seq(prompt)
    admit(bm, a)
    compute_all(bm, a)
    b = make_seq(prompt)
    hits, num_cached = bm.get_computed_blocks(b)
    assert len(hits) == expected_hits
    assert num_cached == expected_hits * BS
    assert num_cached < b.num_tokens


def test_hit_on_freed_blocks_revives_them():
    bm = BlockManager(num_blocks=6, block_size=BS)
    prompt = list(range(9))
    a = make_seq(prompt)
    admit(bm, a)
    compute_all(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    assert all(b in bm.free_queue for b in cached)
    b = make_seq(prompt)
    assert admit(bm, b) == 8
    assert b.block_table[:2] == cached
    assert all(b not in bm.free_queue and bm.blocks[b].ref_count == 1 for b in cached)
    assert bm.num_free_blocks == 6 - 3


@pytest.mark.parametrize(
    ("lora", "tenant", "expect_hit"),
    [
        (LORA_A, "t1", True),
        (LORA_B, "t1", False),  # another adapter changes K/V of the same tokens
        (None, "t1", False),
        (LORA_A, "t2", False),  # another tenant must not share (timing side channel)
        (LORA_A, None, False),
        (LoRARequest("a-again", 1, "/elsewhere"), "t1", True),  # the int id names the adapter
    ],
)
def test_cache_is_keyed_by_adapter_and_tenant(lora, tenant, expect_hit):
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(40, 50))
    a = make_seq(prompt, lora=LORA_A, tenant="t1")
    admit(bm, a)
    compute_all(bm, a)
    hits, num_cached = bm.get_computed_blocks(make_seq(prompt, lora=lora, tenant=tenant))
    assert (num_cached == 8) is expect_hit
    assert bool(hits) is expect_hit


def test_hits_stop_at_first_differing_block():
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(60, 73))  # 3 full blocks + 1
    a = make_seq(prompt)
    admit(bm, a)
    compute_all(bm, a)
    changed_second = prompt[:4] + [0] + prompt[5:]
    hits, num_cached = bm.get_computed_blocks(make_seq(changed_second))
    assert hits == a.block_table[:1] and num_cached == 4
    # Same third block but a different first one: the key chains the whole prefix.
    changed_first = [0] + prompt[1:]
    assert bm.get_computed_blocks(make_seq(changed_first)) == ([], 0)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    a = make_seq(prompt)
    admit(bm, a)
    compute_all(bm, a)
    assert bm.cached == {}
    assert bm.get_computed_blocks(make_seq(prompt)) == ([], 0)


# ---------------------------------------------------------------------------- LRU eviction
def test_freed_blocks_are_reused_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    prompt = list(range(9))
    a = make_seq(prompt)
    admit(bm, a)  # blocks 0, 1 (full, cached after compute) and 2 (partial)
    compute_all(bm, a)
    first, second, tail = a.block_table
    bm.free(a)

    def probe_hits() -> int:
        return bm.get_computed_blocks(make_seq(prompt))[1] // BS

    # Never-used blocks are older in the free queue than anything just freed.
    c = make_seq(range(100, 112))
    assert bm.allocate_slots(c, 12)
    assert set(c.block_table).isdisjoint({first, second, tail})
    assert probe_hits() == 2
    # Then a's blocks, tail first: the partial block, then the deepest cached block.
    d = make_seq(range(200, 204))
    assert bm.allocate_slots(d, 4)
    assert d.block_table == [tail] and probe_hits() == 2
    e = make_seq(range(300, 304))
    assert bm.allocate_slots(e, 4)
    assert e.block_table == [second]
    assert bm.blocks[second].key is None, "an evicted block loses its cache entry"
    assert second not in bm.cached.values()
    assert probe_hits() == 1
    f = make_seq(range(400, 404))
    assert bm.allocate_slots(f, 4)
    assert f.block_table == [first] and probe_hits() == 0
    assert bm.cached == {}
    for s in (c, d, e, f):
        bm.free(s)
    bm.check_all_free()


def test_recently_hit_block_outlives_older_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    p1, p2 = list(range(5)), list(range(50, 55))
    for p in (p1, p2):
        s = make_seq(p)
        admit(bm, s)
        compute_all(bm, s)
        bm.free(s)
    # Touch p1 again: its block goes to the back of the queue when freed.
    s = make_seq(p1)
    assert admit(bm, s) == 4
    compute_all(bm, s)
    bm.free(s)
    assert bm.get_computed_blocks(make_seq(p2))[1] == 4
    # Two new blocks come from the least recently freed: p2's, not p1's.
    filler = make_seq(range(100, 108))
    assert bm.allocate_slots(filler, 8)
    assert bm.get_computed_blocks(make_seq(p1))[1] == 4, "the recently used prefix survives"
    assert bm.get_computed_blocks(make_seq(p2))[1] == 0, "the older one was evicted"


# ---------------------------------------------------------------------------- property test
class _Model:
    """Random allocate / compute / cache / preempt / free traffic against a shadow KV store."""

    def __init__(self, seed: int, num_blocks: int, bs: int):
        self.rng = random.Random(seed)
        self.bs = bs
        self.bm = BlockManager(num_blocks, bs)
        self.active: dict[int, tuple[Sequence, int]] = {}  # seq_no -> (seq, scheduled tokens)
        self.waiting: list[Sequence] = []
        self.kv: dict[int, list] = {}  # block id -> per-slot content written by "the model"
        self.prefixes = [[self.rng.randrange(5, 60) for _ in range(12)] for _ in range(3)]

    def content(self, seq: Sequence, p: int) -> tuple:
        return (seq.adapter_id, seq.tenant, tuple(seq.token_at(i) for i in range(p + 1)))

    def new_seq(self) -> Sequence:
        r = self.rng
        prefix = r.choice(self.prefixes)[: r.randrange(0, 13)]
        tokens = prefix + [r.randrange(5, 60) for _ in range(r.randrange(1, 10))]
        lora = r.choice([None, None, LORA_A, LORA_B])
        return make_seq(tokens, lora=lora, tenant=r.choice([None, "t1"]))

    def admit(self, seq: Sequence) -> None:
        bm = self.bm
        hits, num_cached = bm.get_computed_blocks(seq)
        for i, b in enumerate(hits):  # a hit must hold exactly this sequence's KV
            for j in range(self.bs):
                assert self.kv[b][j] == self.content(seq, i * self.bs + j)
        chunk = min(seq.num_tokens - num_cached, self.rng.randrange(1, 12))
        before = (list(bm.free_queue), ref_counts(bm))
        if bm.allocate_slots(seq, chunk, hits):
            bm.record_prefix_lookup(num_cached)
            seq.num_computed_tokens = num_cached
            self.active[seq.seq_no] = (seq, chunk)
            if seq in self.waiting:
                self.waiting.remove(seq)
        else:
            assert seq.block_table == []
            assert (list(bm.free_queue), ref_counts(bm)) == before
            if seq not in self.waiting:
                self.waiting.append(seq)

    def advance(self, seq: Sequence, scheduled: int) -> None:
        bm, bs = self.bm, self.bs
        if scheduled:  # the model writes the KV of the scheduled tokens
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + scheduled):
                block = seq.block_table[p // bs]
                assert bm.blocks[block].ref_count == 1, "writing into a shared block"
                self.kv.setdefault(block, [None] * bs)[p % bs] = self.content(seq, p)
            seq.num_computed_tokens += scheduled
            bm.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(self.rng.randrange(5, 60))
            self.active[seq.seq_no] = (seq, 0)
            return
        n = min(seq.num_tokens - seq.num_computed_tokens, self.rng.randrange(1, 8))
        if bm.allocate_slots(seq, n):
            self.active[seq.seq_no] = (seq, n)
        else:  # preempt by recompute
            bm.free(seq)
            seq.num_computed_tokens = 0
            del self.active[seq.seq_no]
            self.waiting.append(seq)

    def step(self) -> None:
        r = self.rng
        op = r.random()
        if op < 0.3 or not self.active:
            self.admit(
                r.choice(self.waiting) if self.waiting and r.random() < 0.5 else self.new_seq()
            )
        elif op < 0.85:
            self.advance(*self.active[r.choice(list(self.active))])
        else:
            seq, _ = self.active.pop(r.choice(list(self.active)))
            self.bm.free(seq)

    def check(self) -> None:
        bm = self.bm
        tables = [s.block_table for s, _ in self.active.values()]
        assert all(s.block_table == [] for s in self.waiting)
        assert sum(ref_counts(bm)) == sum(len(t) for t in tables)
        assert set(bm.free_queue) == {b.block_id for b in bm.blocks if b.ref_count == 0}
        holders: dict[int, list[int]] = {}
        for t in tables:
            assert len(set(t)) == len(t)
            for i, b in enumerate(t):
                holders.setdefault(b, []).append(i)
        for b, positions in holders.items():
            assert bm.blocks[b].ref_count == len(positions)
            if len(positions) > 1:  # only cached prefix blocks are shared, at the same index
                assert bm.blocks[b].key is not None
                assert len(set(positions)) == 1
        for s, scheduled in self.active.values():
            assert len(s.block_table) == bm.blocks_needed(s.num_computed_tokens + scheduled)
        keyed = {b.block_id: b.key for b in bm.blocks if b.key is not None}
        assert {b: key for key, b in bm.cached.items()} == keyed
        for b in keyed:
            assert all(c is not None for c in self.kv[b]), "a cached block is fully computed"
        assert bm.num_free_blocks + len(holders) == bm.num_blocks


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_invariants(seed):
    model = _Model(seed, num_blocks=12, bs=BS)
    for _ in range(500):
        model.step()
        model.check()
    assert model.bm.prefix_hits > 0, "the traffic should exercise cache hits"
    for seq, _ in list(model.active.values()):
        model.bm.free(seq)
    model.active.clear()
    model.bm.check_all_free()
    assert set(ref_counts(model.bm)) == {0}
