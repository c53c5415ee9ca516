"""Keys that cannot collide, and stored blocks that verify themselves.

A block's KV depends on every token before it, on the base model's weights, on the adapter's
weights (LoRA on k / v changes the KV of the same tokens), on the KV cache's element type and
layout, and must never reach another tenant. Its store key is therefore

    namespace = blake2b-32( base model identity | KV layout | adapter version digest
                            | tenant | the operator's salt )
    store key = blake2b-32( namespace | the prefix cache's block-hash chain key )

    base model identity   config.json's bytes, each weight file's name and size, dtype and
                          quantization (a re-trained checkpoint in the same folder is new)
    KV layout             block size, kv_cache_dtype and every cached tensor's dtype and
                          per-block shape (layers, K / V, int8 scales)
    adapter version       sha256 of the adapter folder's files (a new version under the same
                          name and id is a new digest); no adapter: "base"
    tenant                the request's tenant (the prefix cache's salt)
    salt                  kv_tier_salt: changing it makes every stored entry unreachable

The chain key already hashes every token of the prefix (engine/memory/block_manager.py), so
two prefixes share a store key only if blake2b collides; it also holds the request's cache
salt (SamplingParams.cache_salt: the tenant's, which the platform rotates), so a rotated salt
reaches the store key through it.

A stored record is its header, then the block's raw bytes (no pickle: a store another
process writes must never be able to run code here):

    | magic "LPKV1\\0" 6 B | store key 32 B | payload length u64 LE | blake2b-16(key|payload) |
    | payload: every cached tensor's rows of the block, in layout order |

`decode` returns the payload only when the magic, the key, the length (the layout's block
size) and the checksum all match: a corrupt, truncated or misplaced record is a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

MAGIC = b"LPKV1\0"
_HEADER = struct.Struct("<6s32sQ16s")
HEADER_BYTES = _HEADER.size


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))  # length-prefixed: no two splits hash alike
        h.update(p)
    return h.digest()


def model_identity(model_dir: str | Path, dtype: str, quantization: str | None) -> bytes:
    """The base model as the KV depends on it: its config and weight files, dtype, quantization."""
    folder = Path(model_dir)
    parts = [(folder / "config.json").read_bytes() if (folder / "config.json").exists() else b""]
    for f in sorted(folder.glob("*.safetensors")):
        parts.append(f"{f.name}:{f.stat().st_size}".encode())
    parts += [dtype.encode(), str(quantization).encode()]
    return _digest(*parts)


_adapter_digests: dict[tuple, bytes] = {}


def adapter_digest(lora) -> bytes:
    """The adapter version's digest: sha256 of its folder's files (cached per file state).
    A path that is not a folder here (an embedder's own id) is named by name, id and path."""
    if lora is None:
        return b"base"
    folder = Path(lora.lora_path)
    files = sorted(f for f in folder.glob("*") if f.is_file()) if folder.is_dir() else []
    state = (lora.lora_name, lora.lora_int_id, str(folder),
             tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))  # fmt: skip
    digest = _adapter_digests.get(state)
    if digest is None:
        h = hashlib.sha256(f"{lora.lora_name}\0{lora.lora_int_id}\0".encode())
        for f in files:
            h.update(f.name.encode() + b"\0")
            h.update(f.read_bytes())
        if not files:
            h.update(str(folder).encode())
        digest = _adapter_digests[state] = h.digest()
    return digest


def namespace(model: bytes, layout: str, adapter: bytes, tenant: str | None, salt: str) -> bytes:
    return _digest(model, layout.encode(), adapter, (tenant or "").encode(), salt.encode())


def store_key(ns: bytes, chain_key: bytes) -> bytes:
    return _digest(ns, chain_key)


def encode(key: bytes, payload: bytes) -> bytes:
    check = hashlib.blake2b(key + payload, digest_size=16).digest()
    return _HEADER.pack(MAGIC, key, len(payload), check) + payload


def decode(key: bytes, record: bytes | None, payload_bytes: int) -> bytes | None:
    """The payload of `record` if it is `key`'s, whole and intact; else None (a miss)."""
    if record is None or len(record) != HEADER_BYTES + payload_bytes:
        return None
    magic, got_key, length, check = _HEADER.unpack_from(record)
    payload = record[HEADER_BYTES:]
    if magic != MAGIC or got_key != key or length != payload_bytes:
        return None
    if hashlib.blake2b(key + payload, digest_size=16).digest() != check:
        return None
    return payload


def layout_string(segments) -> str:
    """The KV layout as text: block size, element type and per-block shape of each segment."""
    return json.dumps(segments, sort_keys=True)


def tmp_name(path: Path) -> Path:
    """A writer-private temporary beside `path` (atomic rename target)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
