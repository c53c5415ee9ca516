"""`dataPlane.kind: embedded | vllm`, rendered by real helm and validated as a cluster would:
vLLM deployed by the chart (a StatefulSet with the adapter agent beside each server, tensor
parallel across the pod's GPUs) or an existing fleet's URLs; and the platform's own pods,
no GPU, reading the settings the server accepts."""

from __future__ import annotations

import pytest

from loraplex.platform.settings import Settings
from tests.helm.chart import (
    NAMESPACE,
    RELEASE,
    SECRETS,
    kinds,
    render,
    run_helm,
    template_error,
    validate,
)

VLLM = {"kind": "vllm", "vllm": {"replicas": 3, "tensorParallelSize": 4,
                                 "resources": {"limits": {"nvidia.com/gpu": 4}},
                                 "extraArgs": ["--enable-expert-parallel"]}}  # fmt: skip
EXISTING = {"kind": "vllm", "vllm": {"deploy": False, "urls": ["http://vllm-a:8000",
                                                               "http://vllm-b:8000"]}}  # fmt: skip


@pytest.mark.parametrize("plane", [{}, VLLM, EXISTING], ids=["embedded", "vllm", "existing"])
def test_each_kind_lints_renders_and_validates(plane):
    values = {"secrets": SECRETS, "modelVolume": {"existingClaim": "models"},
              "config": {"model": "/models/base"}, "dataPlane": plane}  # fmt: skip
    lint = run_helm("lint", "--strict", "--namespace", NAMESPACE, values=values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(values)
    assert [p for doc in docs for p in validate(doc)] == []


def test_embedded_is_the_default_and_unchanged():
    kinds_ = kinds(render({"secrets": SECRETS}))
    assert "StatefulSet" not in kinds_
    assert "LORAPLEX_DATA_PLANE" not in kinds_["ConfigMap"][0]["data"]
    (server,) = kinds_["Deployment"]
    gpu = server["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu["nvidia.com/gpu"] == 1


def test_vllm_deployed_with_the_chart(monkeypatch, tmp_path):
    kinds_ = kinds(render({"secrets": SECRETS, "dataPlane": VLLM}))
    (vllm,) = kinds_["StatefulSet"]
    spec = vllm["spec"]["template"]["spec"]
    server, agent = spec["containers"]
    assert vllm["spec"]["replicas"] == 3
    assert "--tensor-parallel-size=4" in server["args"] and "--enable-lora" in server["args"]
    assert "--scheduling-policy=priority" in server["args"]
    assert "--enable-expert-parallel" in server["args"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in server["env"]
    assert agent["args"][0] == "agent"
    # The agent writes where vLLM reads: one volume of the pod, vLLM's read-only.
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (server, agent)}
    assert mounts["vllm"]["adapters"]["readOnly"] and "readOnly" not in mounts["agent"]["adapters"]
    # The platform: no GPU, and the URL of every vLLM pod (and its agent), by stable name.
    platform = next(d for d in kinds_["Deployment"] if d["metadata"]["name"] == "prod-loraplex")
    limits = platform["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits
    env = dict(kinds_["ConfigMap"][0]["data"])
    name = f"{RELEASE}-loraplex-vllm"
    assert env["LORAPLEX_VLLM_URLS"] == ",".join(
        f"http://{name}-{i}.{name}.{NAMESPACE}.svc:8000" for i in range(3)
    )
    assert env["LORAPLEX_VLLM_AGENT_URLS"].count(":8100") == 3
    (headless,) = [s for s in kinds_["Service"] if s["metadata"]["name"] == name]
    assert headless["spec"]["clusterIP"] == "None"
    assert vllm["spec"]["serviceName"] == name
    # The server reads what the chart wrote.
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    settings = Settings(dev_mode=True)
    assert settings.data_plane == "vllm" and settings.vllm_urls.count(",") == 2


def test_an_existing_fleet_by_url():
    kinds_ = kinds(render({"secrets": SECRETS, "dataPlane": EXISTING}))
    assert "StatefulSet" not in kinds_
    env = kinds_["ConfigMap"][0]["data"]
    assert env["LORAPLEX_VLLM_URLS"] == "http://vllm-a:8000,http://vllm-b:8000"
    assert "LORAPLEX_VLLM_AGENT_URLS" not in env


def test_an_existing_fleet_needs_its_urls():
    plane = {"kind": "vllm", "vllm": {"deploy": False}}
    error = template_error({"secrets": SECRETS, "dataPlane": plane})
    assert "urls" in error
