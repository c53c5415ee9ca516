"""The tensor-parallel group's messages as bytes, and back: written by hand, not pickled.

Why a codec of our own: the project unpickles nothing, anywhere (a pickle runs whatever code
its bytes name), and torch.distributed's object collectives pickle. What crosses between the
ranks is known and ours: tuples of names and numbers, the step's plan (ForwardContext and its
parts, the kernel backends' plans, a graph-ready step's DecodeInputs) and the adapters a slot
write carries (LoRAAdapter). So a message is a JSON header, which names only the dataclasses
listed in `_CLASSES` and tags tuples, dicts, sets, dtypes and tensors, followed by each
tensor's raw bytes. Decoding builds nothing but those classes, plain values and tensors of the
listed dtypes, and refuses anything else with a ValueError that says what it found.

Layout: 8 bytes (little-endian) the header's length, the header (UTF-8 JSON), then the
tensors' bytes one after another, as the header's ["T", dtype, shape, device, offset] say.
A tensor made on a GPU is decoded onto the receiving rank's own device.
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from loraplex.engine.adapters.lora import LoRAAdapter
from loraplex.engine.forward_context import (
    AttentionMetadata,
    DoRARows,
    ForwardContext,
    LoRABatch,
    StaticDecode,
)
from loraplex.engine.models.spec import RopeSpec
from loraplex.engine.step.graph_runner import DecodeInputs
from loraplex.kernels.cpu_plan import (
    Batched,
    CPUAttentionPlan,
    CPULoRAPlan,
    DecodeGroup,
    Dense,
    LoRAGroup,
)
from loraplex.kernels.plans import SGMVMeta, TritonAttentionPlan

_CLASSES = {
    c.__name__: c
    for c in (
        ForwardContext,
        AttentionMetadata,
        LoRABatch,
        DoRARows,
        StaticDecode,
        DecodeInputs,
        CPUAttentionPlan,
        DecodeGroup,
        CPULoRAPlan,
        LoRAGroup,
        Dense,
        Batched,
        TritonAttentionPlan,
        SGMVMeta,
        LoRAAdapter,
        RopeSpec,  # a RoPE table's key names it
    )
}
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_HEAD = 8
_MAX_DEPTH = 64


class _Encoder:
    def __init__(self):
        self.chunks: list[bytes] = []
        self.offset = 0

    def value(self, v):
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else ["F", repr(v)]
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, torch.dtype):
            return ["D", self.dtype(v)]
        if isinstance(v, tuple):
            return ["t", [self.value(x) for x in v]]
        if isinstance(v, list):
            return ["l", [self.value(x) for x in v]]
        if isinstance(v, frozenset):
            return ["s", [self.value(x) for x in v]]
        if isinstance(v, dict):
            return ["d", [[self.value(k), self.value(x)] for k, x in v.items()]]
        if dataclasses.is_dataclass(v) and _CLASSES.get(type(v).__name__) is type(v):
            names = [f.name for f in dataclasses.fields(v)]
            extra = set(getattr(v, "__dict__", {})) - set(names)
            if extra:  # attributes the class does not declare would be lost
                raise TypeError(f"{type(v).__name__} carries undeclared attributes {extra}")
            return ["C", type(v).__name__, {n: self.value(getattr(v, n)) for n in names}]
        raise TypeError(f"a tensor-parallel message cannot carry {type(v).__qualname__}")

    @staticmethod
    def dtype(d: torch.dtype) -> str:
        name = str(d).removeprefix("torch.")
        if _DTYPES.get(name) is not d:
            raise TypeError(f"a tensor-parallel message cannot carry dtype {d}")
        return name

    def tensor(self, t: torch.Tensor):
        dtype = self.dtype(t.dtype)
        flat = t.detach().contiguous().reshape(-1)
        data = flat.cpu().view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        self.chunks.append(data)
        ref = ["T", dtype, list(t.shape), t.device.type, self.offset]
        self.offset += len(data)
        return ref


def encode(message) -> bytes:
    """`message` as bytes (TypeError: a value the codec does not carry)."""
    enc = _Encoder()
    header = json.dumps(enc.value(message), separators=(",", ":"), allow_nan=False).encode()
    return b"".join([len(header).to_bytes(_HEAD, "little"), header, *enc.chunks])


class _Decoder:
    def __init__(self, body: memoryview, device: torch.device):
        self.body, self.device = body, device

    def fail(self, what: str):
        raise ValueError(f"not a tensor-parallel message: {what}")

    def value(self, v, depth: int = 0):
        if v is None or isinstance(v, (bool, str, int, float)):
            return v
        if depth > _MAX_DEPTH:
            self.fail("nested too deep")
        if not isinstance(v, list) or not v or not isinstance(v[0], str):
            self.fail(f"unexpected {type(v).__name__} in the header")
        tag, args = v[0], v[1:]
        d = depth + 1
        if tag == "t" and len(args) == 1 and isinstance(args[0], list):
            return tuple(self.value(x, d) for x in args[0])
        if tag == "l" and len(args) == 1 and isinstance(args[0], list):
            return [self.value(x, d) for x in args[0]]
        if tag == "s" and len(args) == 1 and isinstance(args[0], list):
            return frozenset(self.value(x, d) for x in args[0])
        if tag == "d" and len(args) == 1 and isinstance(args[0], list):
            pairs = args[0]
            if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                self.fail("a dict entry is not a pair")
            return {self.value(k, d): self.value(x, d) for k, x in pairs}
        if tag == "F" and args in (["inf"], ["-inf"], ["nan"]):
            return float(args[0])
        if tag == "D" and len(args) == 1 and args[0] in _DTYPES:
            return _DTYPES[args[0]]
        if tag == "T" and len(args) == 4:
            return self.tensor(*args)
        if tag == "C" and len(args) == 2 and isinstance(args[1], dict):
            return self.instance(args[0], args[1], d)
        self.fail(f"unknown entry {str(v)[:80]!r}")

    def instance(self, name, fields: dict, depth: int):
        cls = _CLASSES.get(name) if isinstance(name, str) else None
        if cls is None:
            self.fail(f"class {str(name)[:80]!r} is not one a message carries")
        declared = {f.name for f in dataclasses.fields(cls)}
        if set(fields) != declared:
            self.fail(f"{name}'s fields {sorted(fields)} are not {sorted(declared)}")
        obj = object.__new__(cls)  # frozen ones too; __init__ has nothing else to do
        for k, v in fields.items():
            object.__setattr__(obj, k, self.value(v, depth))
        return obj

    def tensor(self, dtype, shape, device, offset):
        if dtype not in _DTYPES:
            self.fail(f"tensor dtype {str(dtype)[:40]!r}")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            self.fail(f"tensor shape {str(shape)[:80]!r}")
        if device not in ("cpu", "cuda") or type(offset) is not int or offset < 0:
            self.fail("tensor device or offset")
        dt = _DTYPES[dtype]
        numel = math.prod(shape)
        nbytes = numel * dt.itemsize
        if offset + nbytes > len(self.body):
            self.fail("a tensor runs past the message's end")
        if numel == 0:
            t = torch.empty(shape, dtype=dt)
        else:
            raw = bytearray(self.body[offset : offset + nbytes])  # its own, writable copy
            t = torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(shape)
        return t.to(self.device) if device == "cuda" else t


def decode(data: bytes | bytearray, device: torch.device | str = "cpu"):
    """The message `data` encodes (ValueError: bytes that are not one); tensors made on a GPU
    land on `device`."""
    view = memoryview(data)
    if len(view) < _HEAD:
        raise ValueError("not a tensor-parallel message: shorter than its header's length")
    n = int.from_bytes(view[:_HEAD], "little")
    if n > len(view) - _HEAD:
        raise ValueError("not a tensor-parallel message: its header runs past its end")
    try:
        header = json.loads(bytes(view[_HEAD : _HEAD + n]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"not a tensor-parallel message: its header is not JSON ({e})") from None
    return _Decoder(view[_HEAD + n :], torch.device(device)).value(header)
