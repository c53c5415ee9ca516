"""The tensor-parallel group's communication: all-reduce of partial sums, and the broadcast
of rank 0's step plan, over a torch.distributed process group of its own (gloo on the CPU,
NCCL on GPUs), not the process-wide default group: several engines may live in one process.

Every collective but the workers' wait for the next message runs under `STEP_TIMEOUT`, so a
peer that hangs ends the step with an error; a peer that dies closes its sockets, which ends
the collective at once. The workers wait for their next message without a bound (a server may
sit idle for days), and end when rank 0's process closes its sockets.

Counters (`bytes_reduced`, `bytes_broadcast`) count the payload each rank sends or receives,
per collective, for docs/tensor-parallel.md's bytes-per-step figures.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from loraplex.engine.parallel import codec

STEP_TIMEOUT = datetime.timedelta(seconds=120)
_IDLE_TIMEOUT = datetime.timedelta(days=365)


class Group:
    """One rank's end of the group. Rank 0 creates the store (`port` 0: a free port)."""

    def __init__(self, rank: int, world: int, host: str, port: int, backend: str = "gloo"):
        self.rank, self.world, self.backend = rank, world, backend
        self.store = dist.TCPStore(
            host, port, world, rank == 0, timeout=STEP_TIMEOUT, wait_for_workers=False
        )
        self.port = self.store.port
        self.pg = None
        self.bytes_reduced = 0
        self.bytes_broadcast = 0

    def connect(self) -> None:
        """Join the process group (blocks until every rank has joined)."""
        # the plan crosses on the CPU (gloo) whatever the device; NCCL reduces GPU tensors
        self.cpu_pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.store), self.rank,
                                            self.world, _IDLE_TIMEOUT)  # fmt: skip
        self.pg = self.cpu_pg
        if self.backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self.store), self.rank,
                                            self.world)  # fmt: skip

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = STEP_TIMEOUT
        self.pg.allreduce([t], opts).wait()
        self.bytes_reduced += t.numel() * t.element_size()

    def broadcast(self, message=None, idle: bool = False, device: str = "cpu"):
        """Rank 0 sends `message` (engine/parallel/codec.py's bytes: nothing is pickled), the
        others receive and return it, its GPU tensors on `device`. `idle`: wait without a
        bound for it (a worker between steps)."""
        timeout = _IDLE_TIMEOUT if idle else STEP_TIMEOUT
        if self.rank == 0:
            data = codec.encode(message)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.cpu_pg.broadcast(size, 0, timeout).wait()
        n = int(size.item())
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
               else torch.empty(n, dtype=torch.uint8))  # fmt: skip
        self.cpu_pg.broadcast(buf, 0, STEP_TIMEOUT).wait()
        self.bytes_broadcast += n + 8
        if self.rank == 0:
            return message
        return codec.decode(buf.numpy().data, device)
