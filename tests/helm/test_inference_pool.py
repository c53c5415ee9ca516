"""The chart's optional InferencePool + endpoint picker: rendered, and the pool checked against
a JSON schema written from the published inference.networking.k8s.io/v1 types."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from tests.helm.test_chart import SECRETS, _kinds, _render

POOL_SCHEMA = json.loads((Path(__file__).parent / "schemas" / "inferencepool-v1.json").read_text())
ON = {"secrets": SECRETS, "inferencePool": {"enabled": True}}


def _pool_errors(pool: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(POOL_SCHEMA)
    return [e.message for e in validator.iter_errors(pool)]


def test_off_by_default():
    kinds = _kinds(_render({"secrets": SECRETS}))
    assert "InferencePool" not in kinds
    labels = kinds["Deployment"][0]["spec"]["template"]["metadata"]["labels"]
    assert "inference.loraplex.io/pool" not in labels


def test_pool_selects_the_model_servers_and_validates():
    jsonschema.Draft202012Validator.check_schema(POOL_SCHEMA)
    kinds = _kinds(_render(ON))
    (pool,) = kinds["InferencePool"]
    assert _pool_errors(pool) == []
    server, epp = sorted(kinds["Deployment"], key=lambda d: d["metadata"]["name"])
    assert server["metadata"]["name"] == "prod-loraplex"
    # The pool's selector takes every model-server pod and nothing else (not the picker).
    selector = pool["spec"]["selector"]["matchLabels"].items()
    assert selector <= server["spec"]["template"]["metadata"]["labels"].items()
    assert not selector <= epp["spec"]["template"]["metadata"]["labels"].items()
    # It routes to (and the picker scrapes /metrics on) the port the server listens on.
    (port,) = pool["spec"]["targetPorts"]
    container = server["spec"]["template"]["spec"]["containers"][0]
    assert port["number"] == container["ports"][0]["containerPort"] == 8000
    config = kinds["ConfigMap"][0]["data"]
    assert config["LORAPLEX_PORT"] == str(port["number"])
    # The picker: its Service is the pool's endpointPickerRef, its flags name this pool.
    ref = pool["spec"]["endpointPickerRef"]
    (svc,) = [s for s in kinds["Service"] if s["metadata"]["name"] == ref["name"]]
    assert svc["spec"]["ports"][0]["port"] == ref["port"]["number"] == 9002
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    assert "--pool-namespace=serving" in args
    # It may read pods and pools, through its own account.
    (binding,) = kinds["RoleBinding"]
    assert binding["subjects"][0]["name"] == epp["spec"]["template"]["spec"]["serviceAccountName"]
    (role,) = kinds["Role"]
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"pods", "inferencepools"} <= resources


def test_an_external_picker_renders_only_the_pool():
    values = copy.deepcopy(ON)
    values["inferencePool"]["endpointPicker"] = {
        "deploy": False,
        "serviceName": "shared-epp",
        "failureMode": "FailOpen",
    }
    kinds = _kinds(_render(values))
    (pool,) = kinds["InferencePool"]
    assert _pool_errors(pool) == []
    assert pool["spec"]["endpointPickerRef"]["name"] == "shared-epp"
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert len(kinds["Deployment"]) == 1 and "Role" not in kinds


def test_external_picker_without_a_name_is_refused():
    values = copy.deepcopy(ON)
    values["inferencePool"]["endpointPicker"] = {"deploy": False}
    with pytest.raises(jsonschema.ValidationError):
        _render(values)


@pytest.mark.parametrize(
    "breakage",
    [
        lambda s: s.pop("targetPorts"),
        lambda s: s.update(targetPorts=[]),
        lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}]),
        lambda s: s["endpointPickerRef"].pop("port"),  # a Service ref needs its port
        lambda s: s["endpointPickerRef"].update(failureMode="Retry"),
        lambda s: s.update(selector={"app": "x"}),  # v1 wants matchLabels, not a bare map
        lambda s: s.update(targetPortNumber=8000),  # the pre-v1 field
    ],
)
def test_the_schema_catches_what_the_api_server_would(breakage):
    (pool,) = _kinds(_render(ON))["InferencePool"]
    breakage(pool["spec"])
    assert _pool_errors(pool) != []


def test_the_ingress_keeps_metrics_inside_the_cluster():
    """/metrics names every tenant's resident adapters: the public ingress must not route it."""
    kinds = _kinds(_render({"secrets": SECRETS, "ingress": {"enabled": True}}))
    paths = [p["path"] for p in kinds["Ingress"][0]["spec"]["rules"][0]["http"]["paths"]]
    assert sorted(paths) == ["/admin", "/v1"]
    assert not any("/metrics".startswith(p) for p in paths)
