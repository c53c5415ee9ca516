"""transformers + peft behind a small OpenAI-compatible server: the naive baseline.

This is what S-LoRA calls "PEFT": the adapters are loaded into one `PeftModel`; a worker takes
the oldest waiting request and every other waiting request for the same adapter (up to
--max-batch), runs them as one left-padded greedy batch with a plain KV cache until the longest
is done, then takes the next batch. No paged cache, no continuous batching, no mixed-adapter
batches. Tokens are streamed as they are decoded.

    python -m benchmarks.peers.hf_server --model DIR --adapter a0000=PATH ... --port 8012

Only what the benchmark client sends is implemented: /v1/models, and /v1/completions with a
token-id (or text) prompt, max_tokens, greedy, stream with include_usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse

from benchmarks.server import stop_process, wait_until_ok

BASE_NAME = "base"


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    adapter: str | None  # None: the base model
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then None


class Generator:
    def __init__(self, model_dir: Path, adapters: dict[str, Path], dtype: str, max_batch: int):
        import torch
        import transformers
        from tokenizers import Tokenizer

        self.torch = torch
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        )
        self.peft = None
        if adapters:
            from peft import PeftModel

            items = list(adapters.items())
            self.peft = PeftModel.from_pretrained(model, str(items[0][1]), adapter_name=items[0][0])
            for name, path in items[1:]:
                self.peft.load_adapter(str(path), adapter_name=name)
            model = self.peft
        self.model = model.eval()
        self.max_batch = max_batch
        self.waiting: queue.Queue[Job] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="hf-generate").start()

    def _next_batch(self, pending: list[Job]) -> list[Job]:
        """The oldest job and up to max_batch - 1 later ones for the same adapter."""
        if not pending:
            pending.append(self.waiting.get())
        while True:
            try:
                pending.append(self.waiting.get_nowait())
            except queue.Empty:
                break
        first = pending[0]
        batch = [j for j in pending if j.adapter == first.adapter][: self.max_batch]
        for j in batch:
            pending.remove(j)
        return batch

    def _loop(self) -> None:
        pending: list[Job] = []
        while True:
            batch = self._next_batch(pending)
            try:
                self._run(batch)
            except Exception as e:  # report to the clients, keep serving
                for j in batch:
                    j.loop.call_soon_threadsafe(j.out.put_nowait, e)

    def _run(self, batch: list[Job]) -> None:
        torch = self.torch
        adapter = batch[0].adapter
        if adapter is None:
            ctx = self.peft.disable_adapter() if self.peft else contextlib.nullcontext()
        else:
            self.peft.set_adapter(adapter)
            ctx = contextlib.nullcontext()
        width = max(len(j.prompt) for j in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # [batch, width], left padded
        mask = torch.zeros_like(ids)
        for row, j in enumerate(batch):
            ids[row, width - len(j.prompt) :] = torch.tensor(j.prompt)
            mask[row, width - len(j.prompt) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # padding shifts no real token's position
        past = None
        with ctx, torch.inference_mode():
            for step in range(max(j.max_tokens for j in batch)):
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=past,
                    use_cache=True,
                )
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1)  # [batch], greedy
                for row, j in enumerate(batch):
                    if step < j.max_tokens:
                        j.loop.call_soon_threadsafe(j.out.put_nowait, int(nxt[row]))
                        if step + 1 == j.max_tokens:
                            j.loop.call_soon_threadsafe(j.out.put_nowait, None)
                ids = nxt[:, None]
                mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
                pos = pos[:, -1:] + 1


def make_app(gen: Generator, adapter_names: list[str]):
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        ids = [BASE_NAME, *adapter_names]
        return {"object": "list", "data": [{"id": m, "object": "model"} for m in ids]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        model = body.get("model", BASE_NAME)
        if model != BASE_NAME and model not in adapter_names:
            raise HTTPException(404, f"no model {model!r}")
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else gen.tok.encode(prompt).ids
        job = Job(
            ids,
            int(body.get("max_tokens") or 16),
            None if model == BASE_NAME else model,
            asyncio.get_running_loop(),
        )
        gen.waiting.put(job)
        created, rid = int(time.time()), f"cmpl-{id(job)}"

        def chunk(choices, usage=None) -> str:
            obj = {"id": rid, "object": "text_completion", "created": created, "model": model}
            return f"data: {json.dumps({**obj, 'choices': choices, 'usage': usage})}\n\n"

        async def tokens():
            while (item := await job.out.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item

        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": job.max_tokens,
            "total_tokens": len(ids) + job.max_tokens,
        }
        if not body.get("stream"):
            out = [t async for t in tokens()]
            text = gen.tok.decode(out)
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage,
            }

        async def sse():
            n = 0
            async for t in tokens():
                n += 1
                last = n == job.max_tokens
                choice = {
                    "index": 0,
                    "text": gen.tok.decode([t]),
                    "finish_reason": "length" if last else None,
                }
                yield chunk([choice])
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk([], usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


class HFServer:
    """This module's server as a subprocess (same interface as VLLMServer)."""

    name = "hf"

    def __init__(
        self,
        model_dir: Path,
        adapters: dict[str, Path],
        *,
        port: int,
        log: Path,
        dtype: str = "bfloat16",
        max_batch: int = 8,
        threads: int | None = None,  # OMP_NUM_THREADS (None: inherit)
    ):
        self.url = f"http://127.0.0.1:{port}"
        self.model_name = BASE_NAME
        self.adapter_names = list(adapters)
        cmd = [
            sys.executable,
            "-P",  # no cwd on sys.path: a checkout's kernels/ would shadow HF's `kernels`
            "-m",
            "benchmarks.peers.hf_server",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--max-batch",
            str(max_batch),
        ]
        for name, path in adapters.items():
            cmd += ["--adapter", f"{name}={path}"]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        with log.open("a") as out:
            env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 600) -> None:
        wait_until_ok(
            self.proc, f"{self.url}/v1/models", "HF server", self.log_path, timeout_s, 0.5
        )

    def stop(self) -> None:
        stop_process(self.proc, 30)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--port", type=int, default=8012)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-batch", type=int, default=8)
    args = p.parse_args(argv)
    adapters = dict(item.split("=", 1) for item in args.adapter)
    gen = Generator(
        args.model, {k: Path(v) for k, v in adapters.items()}, args.dtype, args.max_batch
    )
    uvicorn.run(
        make_app(gen, list(adapters)), host="127.0.0.1", port=args.port, log_level="warning"
    )


if __name__ == "__main__":
    main()
