"""A tensor-parallel worker (ranks 1..N-1): its shard of the model, KV cache and adapter
slots, and a loop that runs whatever step rank 0 sends (engine/parallel/runtime.py).

Started by rank 0 as `python -P -m loraplex.engine.parallel.worker RANK WORLD PORT BACKEND`
with the engine options as JSON on stdin. It decides nothing: the KV pool's size and the CPU
attention form come from rank 0 at start; each step message carries the slot writes and block
copies to make first, then the step's plan. It exits on rank 0's stop message, and with an
error when rank 0's sockets close (rank 0 died): a worker never outlives its engine.
"""

from __future__ import annotations

import copy
import json
import logging
import sys

import torch

from loraplex.engine.adapters.manager import AdapterManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.parallel.comm import Group
from loraplex.engine.parallel.runtime import eager_on_cuda
from loraplex.engine.parallel.shard import install_all_reduce, shard_adapter, shard_model
from loraplex.engine.sampling.sampler import Sampler
from loraplex.engine.step.model_runner import ModelRunner
from loraplex.engine.weights.loader import load_model

log = logging.getLogger("loraplex.engine")


def serve(config: EngineConfig, rank: int, world: int, group: Group) -> None:
    model = load_model(
        config.model, config.torch_dtype, config.device, max_len=config.max_model_len,
        quantization=config.quantization, shard=lambda m: shard_model(m, rank, world),
    )  # fmt: skip
    install_all_reduce(model, group.all_reduce)
    full = model.full_spec
    slots = config.max_loras if config.enable_lora else 0
    adapters = AdapterManager(model, slots, config.max_lora_rank, config.max_cpu_loras,
                              expert_lora=config.expert_lora)  # fmt: skip
    kind, num_blocks, cpu_attention = group.broadcast(idle=True)
    assert kind == "init", kind
    cfg = copy.copy(config)
    cfg.num_kv_blocks, cfg.cpu_attention = num_blocks, cpu_attention
    runner = ModelRunner(eager_on_cuda(cfg), model, Sampler(set()))
    while True:
        message = group.broadcast(idle=True, device=model.device)
        if message[0] == "stop":
            return
        _, ops, step = message
        with torch.inference_mode():
            for op in ops:
                if op[0] == "slot":
                    adapters._write_slot(op[1], shard_adapter(op[2], full, rank, world))
                elif op[0] == "copy":
                    runner.copy_blocks(op[1])
            if isinstance(step, tuple):
                model(*step)
            else:  # a graph-ready decode step's inputs
                runner.graphs.run(step)


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    backend = sys.argv[4]
    options = json.loads(sys.stdin.read())
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(message)s")
    if backend == "nccl":
        options["device"] = f"cuda:{rank}"
    config = EngineConfig(**options)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    group = Group(rank, world, "127.0.0.1", port, backend)
    group.connect()
    serve(config, rank, world, group)


if __name__ == "__main__":
    main()
