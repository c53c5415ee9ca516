"""The chart's roles (config.role, config.disaggPrefillUrls / disaggDecodeUrls;
docs/disaggregation.md): one release per role, each pod's server reads its role and a front
its workers, by real helm (tests/helm/tools.py)."""

from __future__ import annotations

import base64

import pytest

from loraplex.platform.settings import Settings
from tests.helm.chart import SECRETS, kinds, render, template_error, validate


def _settings(values: dict, monkeypatch) -> Settings:
    docs = render(values)
    for doc in docs:
        assert validate(doc) == []
    env = dict(kinds(docs)["ConfigMap"][0]["data"])
    for k, v in env.items():
        if k.startswith(("LORAPLEX_ROLE", "LORAPLEX_DISAGG")):
            monkeypatch.setenv(k, v)
    return Settings(dev_mode=True)


def test_a_release_is_colocated_by_default(monkeypatch):
    s = _settings({"secrets": SECRETS}, monkeypatch)
    assert s.role == "both" and s.disagg_prefill_urls == "" and s.disagg_decode_urls == ""


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_release_serves_its_role(role, monkeypatch):
    s = _settings({"secrets": SECRETS, "config": {"role": role}}, monkeypatch)
    assert s.role == role


def test_a_front_reads_its_workers(monkeypatch):
    urls = {"disaggPrefillUrls": "http://p-loraplex:8000", "disaggDecodeUrls": "http://d:8000"}
    s = _settings({"secrets": SECRETS, "config": urls}, monkeypatch)
    assert s.role == "both"
    assert (s.disagg_prefill_urls, s.disagg_decode_urls) == (
        "http://p-loraplex:8000",
        "http://d:8000",
    )


def test_an_unknown_role_is_refused():
    assert "role" in template_error({"secrets": SECRETS, "config": {"role": "router"}})


def test_the_secret_reaches_the_workers_from_the_secret_only():
    values = {
        "secrets": SECRETS | {"disaggSecret": "Qm4pW8zX2cV7bN1k"},
        "config": {"role": "decode"},
    }
    docs = kinds(render(values))
    assert "Qm4pW8zX2cV7bN1k" not in str(docs["ConfigMap"][0]["data"])
    c = docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    ref = next(e for e in c["env"] if e["name"] == "LORAPLEX_DISAGG_SECRET")
    secret = next(s for s in docs["Secret"] if "annotations" not in s["metadata"])
    key = ref["valueFrom"]["secretKeyRef"]["key"]
    assert base64.b64decode(secret["data"][key]).decode() == "Qm4pW8zX2cV7bN1k"
