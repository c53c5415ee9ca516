"""Paged KV cache bookkeeping: a block pool with reference counts and a prefix cache.

The pool holds `num_blocks` fixed-size blocks. A sequence owns a block table (logical block i
-> physical block id); token position p lives in slot `table[p // bs] * bs + p % bs`.

Full blocks are content-addressed for prefix caching. The key chains the parent block's key,
the block's tokens, the adapter (LoRA on k/v changes the KV of the same tokens) and a cache
salt (the tenant: one tenant must not learn another's prompts from cache-hit timing). Keys are
cryptographic digests because a colliding key would hand one request another's KV.

Freed blocks keep their key and go to the back of an LRU free queue; allocation takes from the
front, so the least recently used cached blocks are reused first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from loraplex.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self._keys: dict[int, list[bytes]] = {}  # seq_no -> keys of its full blocks
        self.prefix_hits = 0
        self.prefix_queries = 0
        self.prefix_cached_tokens = 0
        # With KV tiers (engine/memory/tiers): (block, chain key, seq) of each block registered
        # since the engine last took them, to be written below the device pool.
        self.tier_new: list[tuple[int, bytes, Sequence]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_key(self, parent: bytes, seq: Sequence, i: int) -> bytes:
        bs = self.block_size
        tokens = np.fromiter(
            (seq.token_at(p) for p in range(i * bs, (i + 1) * bs)), dtype=np.int64, count=bs
        )
        h = hashlib.blake2b(parent, digest_size=16)
        if i == 0:
            h.update(f"{seq.adapter_id}|{seq.tenant or ''}|".encode())
            salt = seq.params.cache_salt
            if salt:  # length-prefixed; an unsalted key is as it was (stored blocks stay found)
                h.update(b"salt" + len(salt.encode()).to_bytes(8, "little") + salt.encode())
        h.update(tokens.tobytes())
        return h.digest()

    def _keys_for(self, seq: Sequence, num_full: int) -> list[bytes]:
        keys = self._keys.setdefault(seq.seq_no, [])
        while len(keys) < num_full:
            keys.append(self._block_key(keys[-1] if keys else b"", seq, len(keys)))
        return keys

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Cached blocks for a new sequence's prefix and the number of tokens they hold.

        At least one token is left to compute so the step produces logits to sample from,
        and a prompt whose logprobs are asked is computed until it is scored.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = seq.max_cached_tokens // self.block_size
        hits: list[int] = []
        for key in self._keys_for(seq, max_blocks):
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_cached_tokens: int) -> None:
        """Count one admitted sequence's prefix-cache lookup (for hit-rate metrics)."""
        self.prefix_queries += 1
        self.prefix_hits += num_cached_tokens > 0
        self.prefix_cached_tokens += num_cached_tokens

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow `seq.block_table` to hold its computed tokens plus `num_new_tokens`.

        Returns False and changes nothing when the pool cannot supply the blocks.
        """
        computed_blocks = computed_blocks or []
        num_cached = len(computed_blocks) * self.block_size
        have = len(seq.block_table) + len(computed_blocks)
        total = max(seq.num_computed_tokens, num_cached) + num_new_tokens
        need = self.blocks_needed(total) - have
        # Cached blocks sitting in the free queue are taken out of it, so count them too.
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if need + revived > self.num_free_blocks:
            return False
        for b in computed_blocks:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free_queue[b]
            block.ref_count += 1
            seq.block_table.append(b)
        for _ in range(max(need, 0)):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        """The least recently freed block, its prefix-cache entry dropped; ref count 1."""
        b, _ = self.free_queue.popitem(last=False)
        block = self.blocks[b]
        if block.key is not None:
            if self.cached.get(block.key) == b:
                del self.cached[block.key]
            block.key = None
        block.ref_count = 1
        return b

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        keys = self._keys_for(seq, num_full)
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.key is None and keys[i] not in self.cached:
                block.key = keys[i]
                self.cached[keys[i]] = block.block_id
                if self.tier_new is not None:
                    self.tier_new.append((block.block_id, keys[i], seq))

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; tail blocks first so they are evicted first."""
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            assert block.ref_count > 0, f"double free of block {b}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[b] = None
        seq.block_table = []
        self._keys.pop(seq.seq_no, None)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Give `child` the KV of `parent`'s first `num_tokens` tokens without computing them.

        Full blocks are shared (reference counted, as prefix-cache hits are); a partly filled
        last block is copied into a fresh block (copy-on-write done eagerly: both will write
        their own next tokens into it). Returns the (source, destination) block copies the
        runner must make, or None, changing nothing, when no block is free for the copy.
        """
        assert not child.block_table
        full, rest = divmod(num_tokens, self.block_size)
        if rest and not self.num_free_blocks:
            return None
        for b in parent.block_table[:full]:
            self.blocks[b].ref_count += 1
            child.block_table.append(b)
        copies = []
        if rest:
            b = self._take_free_block()
            child.block_table.append(b)
            copies.append((parent.block_table[full], b))
        return copies

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's computed tokens (slots that held rejected
        speculative tokens); the next allocation grows the table again."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for b in reversed(seq.block_table[keep:]):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[b] = None
        del seq.block_table[keep:]

    def check_all_free(self) -> None:
        """Assert that no block is held (used by tests and at shutdown)."""
        held = [b.block_id for b in self.blocks if b.ref_count]
        assert not held, f"blocks still referenced: {held[:10]}"
        assert len(self.free_queue) == self.num_blocks
