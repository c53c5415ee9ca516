"""Rank 0's side of a tensor-parallel engine: it starts the other ranks and is the only one
that decides anything.

    rank 0 (the engine's process)                 ranks 1..N-1 (engine/parallel/worker.py)
    scheduler, adapter loads, sampling            a shard of the model, its KV cache and
    ModelRunner.prepare -> the step plan          adapter slots; nothing else
      (ForwardContext: KV slots, block tables,
       LoRA segments and plans, RoPE rows)
    --- broadcast: slot writes, block copies, the plan ---------------------->
    forward on its shard  <--- all-reduce after every o_proj and down_proj --->  forward
    LM head, sampler

The plan crosses as it is built (one message per step, engine/parallel/codec.py's bytes, never
a pickle): no rank plans, schedules or samples on its own, and the others replay exactly the
step rank 0 runs. A graph-ready decode step (engine/step/graph_runner.py) crosses as its
`DecodeInputs` and every rank runs it through its own persistent buffers.

Failure: a rank whose process has exited, or a collective that fails (a peer's sockets
closed mid-step) or outlasts comm.STEP_TIMEOUT, makes the group dead: every rank is stopped
and this step and every later one raise EngineDeadError, which the engine process reports
as a dead engine (its readiness, its requests' errors).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import subprocess
import sys
import weakref
from pathlib import Path

import torch

from loraplex.engine.adapters.manager import AdapterManager
from loraplex.engine.errors import AdapterError, EngineDeadError
from loraplex.engine.options import EngineOptions
from loraplex.engine.parallel.comm import Group
from loraplex.engine.parallel.shard import install_all_reduce, shard_adapter, shard_model
from loraplex.engine.step.model_runner import ModelRunner, StepBatch

log = logging.getLogger("loraplex.engine")


def check_config(config) -> None:
    """What a tensor-parallel engine does not serve yet (ValueError names the option)."""
    n = config.tensor_parallel_size
    unsupported = {
        "quantization='int4'": config.quantization == "int4",  # GPTQ calibrates on one rank
        "swap_space_gib / num_host_kv_blocks": bool(
            config.swap_space_gib or config.num_host_kv_blocks
        ),
        "kv_tier_*": bool(
            config.kv_tier_host_gib or config.kv_tier_disk_path or config.kv_tier_shared_url
        ),
    }
    for what, on in unsupported.items():
        if on:
            raise ValueError(f"tensor_parallel_size {n}: {what} is not supported with it yet")
    if torch.device(config.device).type == "cuda":
        count = torch.cuda.device_count()
        if count < n:
            raise ValueError(f"tensor_parallel_size {n} needs {n} GPUs; torch sees {count}")


def eager_on_cuda(config):
    """The runner's config: on CUDA, decode is not captured as graphs under TP yet (each
    rank's capture runs forwards, whose all-reduces need every rank capturing at once)."""
    if torch.device(config.device).type != "cuda" or config.enforce_eager:
        return config
    config = copy.copy(config)
    config.enforce_eager = True
    return config


def worker_options(config) -> dict:
    """The engine options a worker rebuilds its EngineConfig from (JSON)."""
    opts = {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineOptions)}
    opts["model"] = str(Path(config.model).resolve())
    return opts


def _shutdown(group: Group, procs: list, state: dict) -> None:
    """Stop the workers: a stop message while the group works, then their exit (or a kill)."""
    if not state.get("dead") and all(p.poll() is None for p in procs):
        with contextlib.suppress(RuntimeError):  # a peer already gone: nothing to stop
            group.broadcast(("stop",))
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    state["dead"] = state.get("dead") or "closed"


class TensorParallel:
    """The group as rank 0 sees it: the workers' processes, the collectives, the queue of
    operations the next step message carries, and whether the group is dead."""

    def __init__(self, config):
        check_config(config)
        self.world = config.tensor_parallel_size
        cuda = torch.device(config.device).type == "cuda"
        self.group = Group(0, self.world, "127.0.0.1", 0, "nccl" if cuda else "gloo")
        payload = json.dumps(worker_options(config)).encode()
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, self.world):
            # -P: the working directory is not on the path (a repo root's kernels/ would
            # shadow a package); the options on stdin, not in the process list
            cmd = [sys.executable, "-P", "-m", "loraplex.engine.parallel.worker", str(rank),
                   str(self.world), str(self.group.port), self.group.backend]  # fmt: skip
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
            proc.stdin.write(payload)
            proc.stdin.close()
            self.procs.append(proc)
        self.state: dict = {"dead": None}
        self._finalizer = weakref.finalize(self, _shutdown, self.group, self.procs, self.state)
        try:
            self.group.connect()
        except RuntimeError as e:
            self.fail(f"the ranks did not connect: {e}")
        self.ops: list[tuple] = []  # for the next step message: slot writes, block copies
        log.info("tensor parallel: %d ranks (%s), workers %s", self.world, self.group.backend,
                 [p.pid for p in self.procs])  # fmt: skip

    # ------------------------------------------------------------------ the model
    def shard(self, model):
        return shard_model(model, 0, self.world)

    def attach(self, model) -> None:
        """The loaded shard's all-reduces (after packing or quantization)."""
        install_all_reduce(model, self.group.all_reduce)

    # ------------------------------------------------------------------ messages
    @property
    def dead(self) -> str | None:
        return self.state["dead"]

    def fail(self, reason: str):
        """The group is dead: stop every rank; raise EngineDeadError."""
        if not self.state["dead"]:
            self.state["dead"] = reason
            log.error("tensor-parallel group down: %s", reason)
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
        raise EngineDeadError(f"a tensor-parallel rank failed: {self.state['dead']}")

    def check_alive(self) -> None:
        if self.state["dead"]:
            raise EngineDeadError(f"a tensor-parallel rank failed: {self.state['dead']}")
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                self.fail(f"rank {rank} (pid {p.pid}) exited with status {p.returncode}")

    def send(self, message: tuple) -> None:
        self.check_alive()
        try:
            self.group.broadcast(message)
        except RuntimeError as e:
            self.fail(f"sending the step failed: {e}")

    def close(self) -> None:
        self._finalizer()


class TPAdapterManager(AdapterManager):
    """Rank 0's adapter manager: adapters are read and checked against the whole model, and a
    slot write puts each rank's share into its slot in the same step (the full adapter goes
    with the next step message; each worker takes its share, engine/parallel/shard.py)."""

    def __init__(self, tp: TensorParallel, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.tp = tp
        self.spec = model.full_spec  # what `_read` checks adapters against

    def _base_rows(self):
        def rows(layer: int, target: str):
            raise AdapterError("DoRA adapters are not served with tensor_parallel_size > 1 yet")

        return rows

    def poll(self) -> dict[int, Exception]:
        """As the base class; an adapter on the experts fails its load here (before any slot
        write): expert adapters are not split across ranks yet."""
        failed = super().poll()
        for lora_id, adapter in list(self.host.items()):
            if adapter.experts:
                del self.host[lora_id]
                failed[lora_id] = AdapterError(
                    f"adapter '{adapter.name}': expert LoRA is not served with "
                    "tensor_parallel_size > 1 yet"
                )
        return failed

    def _write_slot(self, slot: int, adapter) -> None:
        mine = shard_adapter(adapter, self.spec, 0, self.tp.world)
        self.tp.ops.append(("slot", slot, adapter))
        super()._write_slot(slot, mine)


class TPModelRunner(ModelRunner):
    """Rank 0's model runner: each step's plan goes to every rank before its forward."""

    def __init__(self, tp: TensorParallel, config, model, sampler):
        super().__init__(eager_on_cuda(config), model, sampler)
        self.tp = tp
        # the KV pool's size and the CPU attention form are rank 0's, so every rank's
        # kernels round alike and the pools hold the same blocks
        tp.send(("init", self.num_blocks, self.cpu_attention))

    def forward(self, batch: StepBatch) -> torch.Tensor:
        tp = self.tp
        ops, tp.ops = tp.ops, []
        step = batch.decode if batch.decode is not None else (
            batch.input_ids, batch.positions, batch.ctx)  # fmt: skip
        tp.send(("step", ops, step))
        try:
            return super().forward(batch)
        except RuntimeError as e:  # a collective failed: a peer died or hung mid-step
            if tp.dead or isinstance(e, EngineDeadError):
                raise
            tp.fail(f"a collective failed mid-step: {e}")

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.tp.ops.append(("copy", list(pairs)))
        super().copy_blocks(pairs)
