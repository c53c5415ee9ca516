"""helm/loraplex rendered by real helm, and every manifest checked as a cluster would.

`render` runs `helm template` (helm validates the values against values.schema.json itself);
`validate` checks a manifest against the Kubernetes API schemas of every cluster version the
chart targets (`kubernetes-validate`, strict: an unknown field is an error), or, for the
custom resources, against their CRDs (tests/helm/crds.py).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.helm import crds, tools

CHART = Path(__file__).resolve().parents[2] / "helm" / "loraplex"
RELEASE, NAMESPACE = "prod", "serving"
SECRETS = {
    "databaseUrl": "postgresql://loraplex:Zq8vN3kPw7@db.internal:5432/loraplex",
    "adminKey": "Yt5bK2mQ9xR4vL7nW1pZ8sD3fG6hJ0cA",
}


def _chart_floor() -> str:
    """The oldest Kubernetes the chart's kubeVersion admits (">=1.25.0-0" -> "1.25.0")."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*(\d+\.\d+\.\d+)(-0)?", constraint)
    assert match, f"a kubeVersion this test reads: {constraint}"
    return match.group(1)


KUBE_FLOOR = _chart_floor()
# The cluster versions every manifest must validate against: the oldest the chart admits and
# the newest kubernetes-validate knows (an API removed since would fail there).
KUBE_VERSIONS = (KUBE_FLOOR, kubernetes_validate.latest_version())


@functools.cache
def _helm() -> str | tools.Unavailable:
    try:
        return str(tools.ensure())
    except tools.Unavailable as e:  # remembered: one fetch attempt per run, not one per test
        return e


def helm() -> str:
    """helm's path; the calling test skips, saying why, where it cannot be had."""
    found = _helm()
    if isinstance(found, tools.Unavailable):
        pytest.skip(f"real helm is not available: {found}")
    return found


@functools.cache
def _promtool() -> str | tools.Unavailable:
    try:
        return str(tools.ensure_promtool())
    except tools.Unavailable as e:
        return e


def promtool() -> str:
    """promtool's path; the calling test skips, saying why, where it cannot be had."""
    found = _promtool()
    if isinstance(found, tools.Unavailable):
        pytest.skip(f"promtool is not available: {found}")
    return found


def prometheus() -> str:
    """The Prometheus server from the same Debian package as promtool (or a skip)."""
    return str(Path(promtool()).with_name("prometheus"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses duplicate keys (Kubernetes would keep only the last silently)."""


def _no_duplicates(loader, node, deep=False):
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate keys {dupes}", node.start_mark
        )
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def run_helm(*args: str, values: dict | None = None, chart: Path = CHART):
    """helm <args> <chart> -f <values>: the completed process (not checked)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        json.dump(values or {}, f)  # JSON is YAML
        f.flush()
        return subprocess.run(
            [helm(), *args, str(chart), "--values", f.name],
            capture_output=True,
            text=True,
            timeout=60,
        )


def template(values: dict, *extra: str, chart: Path = CHART) -> str:
    out = run_helm(
        "template", RELEASE, "--namespace", NAMESPACE, "--kube-version", KUBE_FLOOR, *extra,
        values=values, chart=chart,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def template_error(values: dict, *extra: str) -> str:
    """helm's refusal to render these values (its stderr)."""
    out = run_helm(
        "template", RELEASE, "--namespace", NAMESPACE, "--kube-version", KUBE_FLOOR, *extra,
        values=values,
    )  # fmt: skip
    assert out.returncode != 0, "helm rendered values it should refuse"
    return out.stderr


@functools.cache
def _render(values_json: str) -> tuple[dict, ...]:
    docs = []
    for doc in yaml.load_all(template(json.loads(values_json)), Loader=_UniqueKeyLoader):
        if doc is None:
            continue
        for key in ("apiVersion", "kind", "metadata"):
            assert key in doc, f"a manifest without {key}: {doc}"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        docs.append(doc)
    return tuple(docs)


def render(values: dict) -> list[dict]:
    """Every manifest `helm template` makes with these values (a fresh copy each call)."""
    return copy.deepcopy(list(_render(json.dumps(values, sort_keys=True))))


def kinds(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


@functools.cache
def _validate(doc_json: str) -> tuple[str, ...]:
    doc = json.loads(doc_json)
    where = f"{doc['kind']} {doc['metadata']['name']}"
    if crds.known(doc["apiVersion"], doc["kind"]):
        return tuple(f"{where} (CRD): {e}" for e in crds.errors(doc))
    problems = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.path)) or "."
            problems.append(f"{where} (Kubernetes {version}): {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{where}: no schema: {e.message}")
    return tuple(problems)


def validate(doc: dict) -> list[str]:
    """Why a cluster of every targeted version would refuse `doc` (empty: none would)."""
    return list(_validate(json.dumps(doc, sort_keys=True)))
