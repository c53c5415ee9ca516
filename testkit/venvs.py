"""Third-party clients, each in a venv of its own, installed with pip as their users do.

The venvs live under `.venv-clients/` at the checkout's root (gitignored; elsewhere with
`LORAPLEX_CLIENT_VENVS`) and are reused while their pinned requirements are unchanged. Every
install is constrained to the CPU wheel of torch (`constraints.txt`): a client whose
dependencies ask for torch gets that wheel, and one that would drag in another torch (a
multi-GB CUDA build) fails at resolution instead of downloading it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "tests" / "clients" / "constraints.txt"


def venvs_root() -> Path:
    return Path(os.environ.get("LORAPLEX_CLIENT_VENVS") or REPO / ".venv-clients")


def client_env(**extra: str) -> dict[str, str]:
    """The environment a client runs in: this machine's, less our own venv, with no hub.

    Bytecode is written (PYTHONDONTWRITEBYTECODE dropped): the venvs are installed without
    it, and a client that compiled its imports on every run would spend more on that than on
    its requests."""
    dropped = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(extra)
    return env


def run(cmd: list[str | Path], timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run `cmd`; on a non-zero exit, fail with its output (the client's own words)."""
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd[:3]))} ... exited {proc.returncode}\n"
            f"--- stdout (tail)\n{proc.stdout[-6000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}"
        )
    return proc


def client_venvs(wanted: dict[str, list[str]]) -> dict[str, Future[Path]]:
    """Start making every venv of `wanted` (name -> requirements) at once, in threads: pip
    waits on the network and the disk as much as on a core."""
    pool = ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix="client-venv")
    futures = {name: pool.submit(client_venv, name, reqs) for name, reqs in wanted.items()}
    pool.shutdown(wait=False)
    return futures


def client_venv(name: str, requirements: list[str]) -> Path:
    """The `bin/` folder of venv `name` with `requirements` installed (made on first use)."""
    venv = venvs_root() / name
    venv.parent.mkdir(parents=True, exist_ok=True)
    # Test sessions in one checkout share the venvs: one makes it, the others wait for it.
    with open(venv.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make_venv(venv, requirements)


def _make_venv(venv: Path, requirements: list[str]) -> Path:
    stamp = venv / "loraplex-requirements.txt"
    wanted = "\n".join([*requirements, CONSTRAINTS.read_text()])
    if stamp.is_file() and stamp.read_text() == wanted:
        return venv / "bin"
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", venv], timeout=120)
    # --no-compile: byte-compiling every installed file (torch's thousands) costs more than the
    # install; a client compiles what it imports, on its first run (see client_env).
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile"]
    run([*pip, "-c", CONSTRAINTS, *requirements], timeout=900, env=client_env())
    installed = run([venv / "bin" / "python", "-m", "pip", "list", "--format=freeze"], 60)
    cuda = [line for line in installed.stdout.splitlines() if line.startswith("nvidia-")]
    assert not cuda, f"{venv.name}: a CUDA build was pulled in: {cuda}"
    stamp.write_text(wanted)
    return venv / "bin"
