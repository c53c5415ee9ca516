"""helm/loraplex checked by real helm (v3.17, tests/helm/tools.py) and the Kubernetes schemas.

For the defaults and every option set the chart offers: `helm lint --strict` passes, `helm
template` renders, and every manifest validates against the API schemas of the cluster
versions the chart targets (or its CRD's schema). Then what the manifests must say (GPU,
probes, hooks, labels that agree), what helm refuses, and that the settings the chart hands
the server pass loraplex's own production-mode `Settings`.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil

import jsonschema
import pytest
import yaml

from loraplex.platform.settings import Settings
from tests.helm.chart import (
    CHART,
    KUBE_FLOOR,
    NAMESPACE,
    SECRETS,
    kinds,
    render,
    run_helm,
    template,
    template_error,
    validate,
)

CREDS = {"awsAccessKeyId": "AKIAIOSFODNN7EXAMPLE", "awsSecretAccessKey": "kT9pX2vQ7mL4wR8z"}
MONITORING = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "grafanaDashboard": {"enabled": True, "namespace": "monitoring", "folder": "Serving"},
}
PLACEMENT = {
    "imagePullSecrets": [{"name": "registry"}],
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100,
                "podAffinityTerm": {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "loraplex"}},
                },
            }]
        }
    },
    "podAnnotations": {"prometheus.io/port": "9999", "team": "ml"},
}  # fmt: skip

# Every option the chart offers, each on its own and all together.
OPTION_SETS = {
    "defaults": {"secrets": SECRETS},
    "existing-secret": {"secrets": {"existingSecret": "loraplex-credentials"}},
    "s3-credentials-and-endpoint": {
        "secrets": SECRETS | CREDS,
        "config": {"s3EndpointUrl": "http://minio.storage:9000", "quantization": "int4"},
    },
    "ingress": {"secrets": SECRETS, "ingress": {"enabled": True}},
    "ingress-tls-class-annotations": {
        "secrets": SECRETS,
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "tlsSecretName": "loraplex-tls",
            "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
        },
    },
    "autoscaling": {"secrets": SECRETS, "autoscaling": {"enabled": True}},
    "model-volume": {
        "secrets": SECRETS,
        "modelVolume": {"existingClaim": "models"},
        "config": {"model": "/models/llama", "quantization": "int8"},
    },
    "inference-pool": {"secrets": SECRETS, "inferencePool": {"enabled": True}},
    "inference-pool-external-picker": {
        "secrets": SECRETS,
        "inferencePool": {
            "enabled": True,
            "endpointPicker": {"deploy": False, "serviceName": "shared-epp"},
        },
    },
    "monitoring": {"secrets": SECRETS, "metrics": MONITORING},
    "placement-and-names": {
        "secrets": SECRETS,
        "fullnameOverride": "llm",
        "image": {"tag": "0.1.0-cuda", "pullPolicy": "Always"},
        "service": {"type": "NodePort", "port": 8080},
        **PLACEMENT,
    },
    "minimal": {
        "secrets": SECRETS,
        "serviceAccount": {"create": False, "name": "shared"},
        "migrations": {"enabled": False},
        "podDisruptionBudget": {"enabled": False},
        "metrics": {"scrapeAnnotations": False},
    },
    "everything": {
        "secrets": {"existingSecret": "loraplex-credentials"},
        "ingress": {"enabled": True, "className": "nginx", "tlsSecretName": "loraplex-tls"},
        "autoscaling": {"enabled": True},
        "modelVolume": {"existingClaim": "models"},
        "config": {"model": "/models/llama", "quantization": "int8"},
        "inferencePool": {"enabled": True},
        "metrics": MONITORING,
        "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}},
        **PLACEMENT,
    },
}


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_option_set_lints_renders_and_validates(name):
    values = OPTION_SETS[name]
    lint = run_helm("lint", "--strict", "--namespace", NAMESPACE, values=values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(values)
    assert {"ConfigMap", "Deployment", "Service"} <= set(kinds(docs))
    problems = [p for doc in docs for p in validate(doc)]
    assert problems == []


def test_the_validation_refuses_what_a_cluster_would():
    """The checks above can fail: a misspelt field, a wrong type, a missing required field."""
    docs = kinds(render(OPTION_SETS["everything"]))
    deploy = docs["Deployment"][0]
    deploy["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    assert any("'paht' was unexpected" in p for p in validate(deploy))
    hpa = docs["HorizontalPodAutoscaler"][0]
    hpa["spec"]["maxReplicas"] = "eight"
    assert validate(hpa) != []
    service = docs["Service"][0]
    del service["spec"]["ports"][0]["port"]
    assert validate(service) != []
    monitor = docs["ServiceMonitor"][0]
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert any("intervall" in p for p in validate(monitor))
    rule = docs["PrometheusRule"][0]
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    assert any("'expr' is a required property" in p for p in validate(rule))


def test_values_validate_against_the_schema():
    schema = _schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(_values(), schema)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"secrets": {"adminKey": "too-short"}}, "secrets.adminKey"),
        ({"config": {"dtype": "int3"}}, "config.dtype"),
        ({"config": {"device": "mps"}}, "config.device"),
        ({"config": {"enforceEager": "yes"}}, "config.enforceEager"),
        ({"config": {"gpuMemoryUtilization": 1.5}}, "config.gpuMemoryUtilization"),
        ({"config": {"storeUrl": "https://bucket"}}, "config.storeUrl"),
        ({"replicaCount": 0}, "replicaCount"),
        ({"resources": {"limit": {}}}, "limit"),  # a typo is refused, not ignored
        ({"secrets": {"databaseUrl": "mysql://db/x"}}, "secrets.databaseUrl"),
        ({"metrics": {"prometheusRule": {"errorRatio": 5}}}, "metrics.prometheusRule.errorRatio"),
        ({"metrics": {"prometheusRule": {"selector": "job=x"}}}, "selector"),
        ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "interval"),
    ],
)
def test_helm_refuses_bad_values(bad, field):
    """helm checks values.schema.json itself: a bad value stops the render and is named."""
    values = copy.deepcopy(bad)
    values.setdefault("secrets", {}).setdefault("existingSecret", "x")
    assert field in template_error(values)


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


def test_a_cluster_older_than_the_chart_allows_is_refused():
    major, minor, _ = KUBE_FLOOR.split(".")
    older = f"{major}.{int(minor) - 1}.0"
    error = template_error({"secrets": SECRETS}, "--kube-version", older)
    assert "kubeVersion" in error and "incompatible" in error


def test_default_install_renders_every_piece():
    kinds_ = kinds(render({"secrets": SECRETS}))
    assert set(kinds_) == {
        "ConfigMap", "Deployment", "Job", "PodDisruptionBudget", "Secret", "Service",
        "ServiceAccount",
    }  # fmt: skip
    deploy = kinds_["Deployment"][0]
    assert deploy["spec"]["replicas"] == 2
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["ports"][0]["containerPort"] == 8000
    # The Service, PDB and pods agree on labels.
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert kinds_["Service"][0]["spec"]["selector"].items() <= labels.items()
    pdb = kinds_["PodDisruptionBudget"][0]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Settings come from the chart's ConfigMap and Secret.
    config = kinds_["ConfigMap"][0]["metadata"]["name"]
    assert c["envFrom"] == [{"configMapRef": {"name": config}}]
    regular = [s for s in kinds_["Secret"] if "annotations" not in s["metadata"]]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"]}
    assert refs == {regular[0]["metadata"]["name"]}


def test_migration_job_runs_before_install_and_upgrade():
    kinds_ = kinds(render({"secrets": SECRETS}))
    (job,) = kinds_["Job"]
    hook_secret = next(s for s in kinds_["Secret"] if "annotations" in s["metadata"])
    for manifest in (job, hook_secret):
        assert manifest["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    weight = lambda m: int(m["metadata"]["annotations"]["helm.sh/hook-weight"])  # noqa: E731
    assert weight(hook_secret) < weight(job)  # the Secret the Job reads exists first
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["db", "upgrade"]
    ref = c["env"][1]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == hook_secret["metadata"]["name"] and ref["key"] in hook_secret["data"]


def test_every_option_on():
    kinds_ = kinds(render(OPTION_SETS["everything"]))
    assert "Secret" not in kinds_  # everything reads the operator's own Secret
    assert kinds_["HorizontalPodAutoscaler"][0]["spec"]["maxReplicas"] == 8
    server = next(d for d in kinds_["Deployment"] if d["metadata"]["name"] == "prod-loraplex")
    assert "replicas" not in server["spec"]  # the HPA owns the count
    rule = kinds_["Ingress"][0]["spec"]["rules"][0]
    assert rule["http"]["paths"][0]["backend"]["service"]["name"] == "prod-loraplex"
    pod = server["spec"]["template"]["spec"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in pod["containers"][0][
        "volumeMounts"
    ]
    assert pod["tolerations"] == PLACEMENT["tolerations"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    job_env = kinds_["Job"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert job_env[1]["valueFrom"]["secretKeyRef"]["name"] == "loraplex-credentials"


def test_names_and_placement_follow_the_values():
    kinds_ = kinds(render(OPTION_SETS["placement-and-names"]))
    (deploy,) = kinds_["Deployment"]
    assert deploy["metadata"]["name"] == "llm"
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "ghcr.io/loraplex/loraplex:0.1.0-cuda" and c["imagePullPolicy"] == "Always"
    (svc,) = kinds_["Service"]
    assert svc["spec"]["type"] == "NodePort" and svc["spec"]["ports"][0]["port"] == 8080


def test_minimal_install_leaves_the_optional_pieces_out():
    kinds_ = kinds(render(OPTION_SETS["minimal"]))
    assert not {"Job", "PodDisruptionBudget", "ServiceAccount"} & set(kinds_)
    pod = kinds_["Deployment"][0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "shared"
    # No migration hook: so no hook Secret either, only the regular one.
    assert all("annotations" not in s["metadata"] for s in kinds_["Secret"])


def test_missing_secrets_are_refused_at_render():
    assert "secrets.databaseUrl (or secrets.existingSecret) is required" in template_error({})


def test_notes_name_the_release_service(tmp_path):
    """NOTES.txt, rendered by helm: `helm template` leaves it out, so a copy of the chart
    renders the same text as a manifest."""
    chart = tmp_path / "loraplex"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes + "{{- end -}}\n"
    )
    (chart / "templates" / "notes.yaml").write_text(
        'kind: Notes\ntext: |-\n  {{- include "test.notes" . | nindent 2 }}\n'
    )
    out = template({"secrets": SECRETS}, "--show-only", "templates/notes.yaml", chart=chart)
    text = yaml.safe_load(out)["text"]
    assert "kubectl port-forward svc/prod-loraplex 8000:80" in text
    assert "2 replica(s)" in text and "prod-loraplex (key admin-key)" in text


def test_the_server_accepts_the_chart_settings(monkeypatch, tmp_path):
    """The ConfigMap + Secret, as the pod's environment, pass production-mode validation."""
    kinds_ = kinds(render({"secrets": SECRETS | CREDS}))
    env = dict(kinds_["ConfigMap"][0]["data"])
    secret = next(s for s in kinds_["Secret"] if "annotations" not in s["metadata"])
    c = kinds_["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
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
    assert settings.aws_access_key_id == CREDS["awsAccessKeyId"]
    # Numbers keep their digits (helm reads values' numbers as floats).
    assert settings.max_upload_bytes == _values()["config"]["maxUploadBytes"] == 536870912


def test_replicas_serve_on_their_gpu(monkeypatch):
    """Each replica asks for a GPU and its server runs the engine there ("auto"); the values
    name another device or turn CUDA graphs off, and the server reads what the chart wrote."""

    def env_of(config: dict) -> dict:
        kinds_ = kinds(render({"secrets": SECRETS, "config": config}))
        return dict(kinds_["ConfigMap"][0]["data"])

    env = env_of({})
    assert env["LORAPLEX_DEVICE"] == "auto" and "LORAPLEX_ENFORCE_EAGER" not in env
    assert _values()["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env["LORAPLEX_GPU_MEMORY_UTILIZATION"] == "0.9"
    env = env_of({"device": "cuda:1", "enforceEager": True, "gpuMemoryUtilization": 0.5})
    for k in ("LORAPLEX_DEVICE", "LORAPLEX_ENFORCE_EAGER", "LORAPLEX_GPU_MEMORY_UTILIZATION"):
        monkeypatch.setenv(k, env[k])
    settings = Settings(dev_mode=True)
    assert (settings.device, settings.enforce_eager) == ("cuda:1", True)
    assert settings.gpu_memory_utilization == 0.5
