"""Checks of helm/loraplex as far as our tools reach without `helm` or a cluster.

values.yaml against values.schema.json; every `.Values` path a template uses exists; every
template renders (with tests/helm/gotmpl.py) to well-formed YAML manifests; the manifests say
what the deployment needs (GPU, probes, hooks); and the settings the chart hands the server
are accepted by loraplex's own `Settings` in production mode.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from loraplex.platform.settings import Settings
from tests.helm.gotmpl import Renderer, TemplateError

CHART = Path(__file__).resolve().parents[2] / "helm" / "loraplex"
SECRETS = {
    "databaseUrl": "postgresql://loraplex:Zq8vN3kPw7@db.internal:5432/loraplex",
    "adminKey": "Yt5bK2mQ9xR4vL7nW1pZ8sD3fG6hJ0cA",
}


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


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _render(overrides: dict) -> list[dict]:
    """Every manifest the chart makes with these values (validated first, as helm does)."""
    values = _merge(_values(), overrides)
    jsonschema.validate(values, _schema())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    templates = {p.name: p.read_text() for p in (CHART / "templates").iterdir()}
    renderer = Renderer(templates)
    root = {
        "Values": values,
        "Release": {"Name": "prod", "Namespace": "serving", "Service": "Helm"},
        "Chart": {
            "Name": chart["name"],
            "Version": chart["version"],
            "AppVersion": chart["appVersion"],
        },
    }
    docs = []
    for name in sorted(templates):
        if name.startswith("_"):
            continue
        text = renderer.render(name, root)
        if name == "NOTES.txt":
            assert "prod-loraplex" in text
            continue
        for doc in yaml.load_all(text, Loader=_UniqueKeyLoader):
            if doc is None:
                continue
            for key in ("apiVersion", "kind", "metadata"):
                assert key in doc, f"{name}: a manifest without {key}"
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), name
            docs.append(doc)
    return docs


def _kinds(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_values_validate_against_the_schema():
    schema = _schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(_values(), schema)


@pytest.mark.parametrize(
    "bad",
    [
        {"secrets": {"adminKey": "too-short"}},
        {"config": {"dtype": "int3"}},
        {"config": {"storeUrl": "https://bucket"}},
        {"replicaCount": 0},
        {"resources": {"limit": {}}},  # a typo is refused, not ignored
        {"secrets": {"databaseUrl": "mysql://db/x"}},
    ],
)
def test_schema_refuses_bad_values(bad):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_merge(_values(), bad), _schema())


def test_every_values_path_in_the_templates_exists():
    values = _values()
    missing = []
    for path in sorted((CHART / "templates").iterdir()):
        for ref in set(re.findall(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", path.read_text())):
            node = values
            for key in ref.strip(".").split("."):
                if not isinstance(node, dict) or key not in node:
                    missing.append(f"{path.name}: .Values{ref}")
                    break
                node = node[key]
    assert missing == []


def test_default_install_renders_every_piece():
    kinds = _kinds(_render({"secrets": SECRETS}))
    assert set(kinds) == {
        "ConfigMap", "Deployment", "Job", "PodDisruptionBudget", "Secret", "Service",
        "ServiceAccount",
    }  # fmt: skip
    deploy = kinds["Deployment"][0]
    assert deploy["spec"]["replicas"] == 2
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["ports"][0]["containerPort"] == 8000
    # The Service, PDB and pods agree on labels.
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert kinds["Service"][0]["spec"]["selector"].items() <= labels.items()
    assert (
        kinds["PodDisruptionBudget"][0]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    )
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Settings come from the chart's ConfigMap and Secret.
    config = kinds["ConfigMap"][0]["metadata"]["name"]
    assert c["envFrom"] == [{"configMapRef": {"name": config}}]
    regular = [s for s in kinds["Secret"] if "annotations" not in s["metadata"]]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"]}
    assert refs == {regular[0]["metadata"]["name"]}


def test_migration_job_runs_before_install_and_upgrade():
    kinds = _kinds(_render({"secrets": SECRETS}))
    (job,) = kinds["Job"]
    hook_secret = next(s for s in kinds["Secret"] if "annotations" in s["metadata"])
    for manifest in (job, hook_secret):
        assert manifest["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    weight = lambda m: int(m["metadata"]["annotations"]["helm.sh/hook-weight"])  # noqa: E731
    assert weight(hook_secret) < weight(job)  # the Secret the Job reads exists first
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["db", "upgrade"]
    ref = c["env"][1]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == hook_secret["metadata"]["name"] and ref["key"] in hook_secret["data"]


def test_every_option_on():
    docs = _render({
        "secrets": {"existingSecret": "loraplex-credentials"},
        "ingress": {"enabled": True, "className": "nginx", "tlsSecretName": "tls"},
        "autoscaling": {"enabled": True},
        "modelVolume": {"existingClaim": "models"},
        "config": {"model": "/models/llama", "quantization": "int8"},
    })  # fmt: skip
    kinds = _kinds(docs)
    assert "Secret" not in kinds  # everything reads the operator's own Secret
    assert kinds["HorizontalPodAutoscaler"][0]["spec"]["maxReplicas"] == 8
    assert "replicas" not in kinds["Deployment"][0]["spec"]  # the HPA owns the count
    rule = kinds["Ingress"][0]["spec"]["rules"][0]
    assert rule["http"]["paths"][0]["backend"]["service"]["name"] == "prod-loraplex"
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in pod["containers"][0][
        "volumeMounts"
    ]
    job_env = kinds["Job"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert job_env[1]["valueFrom"]["secretKeyRef"]["name"] == "loraplex-credentials"


def test_missing_secrets_are_refused_at_render():
    with pytest.raises(TemplateError, match="databaseUrl"):
        _render({})


def test_the_server_accepts_the_chart_settings(monkeypatch, tmp_path):
    """The ConfigMap + Secret, as the pod's environment, pass production-mode validation."""
    creds = {"awsAccessKeyId": "AKIAIOSFODNN7EXAMPLE", "awsSecretAccessKey": "kT9pX2vQ7mL4wR8z"}
    kinds = _kinds(_render({"secrets": SECRETS | creds}))
    env = dict(kinds["ConfigMap"][0]["data"])
    secret = next(s for s in kinds["Secret"] if "annotations" not in s["metadata"])
    import base64

    c = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    for e in c["env"]:
        env[e["name"]] = base64.b64decode(
            secret["data"][e["valueFrom"]["secretKeyRef"]["key"]]
        ).decode()
    env["LORAPLEX_DATA_DIR"] = str(tmp_path)  # /data is the pod's volume
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = Settings()
    assert settings.dev_mode is False and settings.host == "0.0.0.0"
    assert settings.database_url.startswith("postgresql+psycopg://")
    assert settings.s3_location == ("loraplex-adapters", "adapters")
    assert settings.admin_key.get_secret_value() == SECRETS["adminKey"]
