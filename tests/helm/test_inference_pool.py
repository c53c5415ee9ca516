"""The chart's optional InferencePool + endpoint picker, rendered by helm, and the pool checked
against the published InferencePool CRD (inference.networking.k8s.io/v1, tests/helm/crds/)
the way an API server with it installed would."""

from __future__ import annotations

import copy

import pytest

from tests.helm import crds
from tests.helm.chart import SECRETS, kinds, render, template_error

ON = {"secrets": SECRETS, "inferencePool": {"enabled": True}}


def test_off_by_default():
    kinds_ = kinds(render({"secrets": SECRETS}))
    assert "InferencePool" not in kinds_
    labels = kinds_["Deployment"][0]["spec"]["template"]["metadata"]["labels"]
    assert "inference.loraplex.io/pool" not in labels


def test_pool_selects_the_model_servers_and_validates():
    kinds_ = kinds(render(ON))
    (pool,) = kinds_["InferencePool"]
    assert crds.errors(pool) == []
    server, epp = sorted(kinds_["Deployment"], key=lambda d: d["metadata"]["name"])
    assert server["metadata"]["name"] == "prod-loraplex"
    # The pool's selector takes every model-server pod and nothing else (not the picker).
    selector = pool["spec"]["selector"]["matchLabels"].items()
    assert selector <= server["spec"]["template"]["metadata"]["labels"].items()
    assert not selector <= epp["spec"]["template"]["metadata"]["labels"].items()
    # It routes to (and the picker scrapes /metrics on) the port the server listens on.
    (port,) = pool["spec"]["targetPorts"]
    container = server["spec"]["template"]["spec"]["containers"][0]
    assert port["number"] == container["ports"][0]["containerPort"] == 8000
    config = kinds_["ConfigMap"][0]["data"]
    assert config["LORAPLEX_PORT"] == str(port["number"])
    # The picker: its Service is the pool's endpointPickerRef, its flags name this pool.
    ref = pool["spec"]["endpointPickerRef"]
    (svc,) = [s for s in kinds_["Service"] if s["metadata"]["name"] == ref["name"]]
    assert svc["spec"]["ports"][0]["port"] == ref["port"]["number"] == 9002
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    assert "--pool-namespace=serving" in args
    # It may read pods and pools, through its own account.
    (binding,) = kinds_["RoleBinding"]
    assert binding["subjects"][0]["name"] == epp["spec"]["template"]["spec"]["serviceAccountName"]
    (role,) = kinds_["Role"]
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"pods", "inferencepools"} <= resources


def test_an_external_picker_renders_only_the_pool():
    values = copy.deepcopy(ON)
    values["inferencePool"]["endpointPicker"] = {
        "deploy": False,
        "serviceName": "shared-epp",
        "failureMode": "FailOpen",
    }
    kinds_ = kinds(render(values))
    (pool,) = kinds_["InferencePool"]
    assert crds.errors(pool) == []
    assert pool["spec"]["endpointPickerRef"]["name"] == "shared-epp"
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert len(kinds_["Deployment"]) == 1 and "Role" not in kinds_


def test_external_picker_without_a_name_is_refused():
    values = copy.deepcopy(ON)
    values["inferencePool"]["endpointPicker"] = {"deploy": False}
    assert "serviceName" in template_error(values)


@pytest.mark.parametrize(
    "breakage, why",
    [
        (lambda s: s.pop("targetPorts"), "'targetPorts' is a required property"),
        (lambda s: s.update(targetPorts=[]), "should be non-empty"),
        (lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8001}]), "too long"),
        (lambda s: s.update(targetPorts=[{"number": 70000}]), "maximum"),
        # A Service ref needs its port: the CRD's CEL rule, evaluated.
        (lambda s: s["endpointPickerRef"].pop("port"), "port is required when kind is 'Service'"),
        (lambda s: s["endpointPickerRef"].update(failureMode="Retry"), "is not one of"),
        (lambda s: s.update(selector={"app": "x"}), "'matchLabels' is a required property"),
        (lambda s: s.update(targetPortNumber=8000), "'targetPortNumber' was unexpected"),  # pre-v1
    ],
)
def test_the_crd_catches_what_the_api_server_would(breakage, why):
    (pool,) = kinds(render(ON))["InferencePool"]
    breakage(pool["spec"])
    errors = crds.errors(pool)
    assert any(why in e for e in errors), errors


def test_the_crd_fills_in_defaults_before_its_rules():
    """kind defaults to Service: a ref without kind or port is refused by the same rule."""
    (pool,) = kinds(render(ON))["InferencePool"]
    ref = pool["spec"]["endpointPickerRef"]
    del ref["kind"]
    assert crds.errors(pool) == []
    del ref["port"]
    assert any("port is required" in e for e in crds.errors(pool))


def test_the_ingress_keeps_metrics_inside_the_cluster():
    """/metrics names every tenant's resident adapters: the public ingress must not route it."""
    kinds_ = kinds(render({"secrets": SECRETS, "ingress": {"enabled": True}}))
    paths = [p["path"] for p in kinds_["Ingress"][0]["spec"]["rules"][0]["http"]["paths"]]
    assert sorted(paths) == ["/admin", "/v1"]
    assert not any("/metrics".startswith(p) for p in paths)
