"""The chart's KV tier values (config.kvTiers, secrets.kvTierSalt; docs/kv-tiers.md) reach
the server as the engine's kv_tier_* settings, by real helm (tests/helm/tools.py)."""

from __future__ import annotations

import base64

from loraplex.platform.settings import Settings
from tests.helm.chart import SECRETS, kinds, render, template_error, validate

TIERS = {
    "hostGib": 2.5,
    "diskPath": "/data/kv-tiers",
    "diskGib": 4,
    "sharedUrl": "redis://kv-redis.serving:6379/2",
    "ttlSeconds": 3600,
}
SALT = "Vb7rT2kLq9Xw4Zp1"


def _settings(values: dict, monkeypatch) -> tuple[Settings, dict]:
    """The server's settings from the rendered ConfigMap and the container's Secret refs."""
    kinds_ = kinds(render(values))
    for doc in render(values):
        assert validate(doc) == []
    env = dict(kinds_["ConfigMap"][0]["data"])
    c = kinds_["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    secret = next(s for s in kinds_["Secret"] if "annotations" not in s["metadata"])
    for e in c["env"]:
        key = e["valueFrom"]["secretKeyRef"]["key"]
        if key in secret["data"]:
            env[e["name"]] = base64.b64decode(secret["data"][key]).decode()
    for k, v in env.items():
        if k.startswith("LORAPLEX_KV_TIER"):
            monkeypatch.setenv(k, v)
    return Settings(dev_mode=True), env


def test_tiers_are_off_by_default(monkeypatch):
    settings, env = _settings({"secrets": SECRETS}, monkeypatch)
    assert settings.kv_tier_host_gib == 0
    assert settings.kv_tier_disk_path is None and settings.kv_tier_shared_url is None
    assert settings.kv_tier_salt == "" and "LORAPLEX_KV_TIER_SALT" not in env


def test_the_server_reads_every_tier_value(monkeypatch):
    values = {"secrets": SECRETS | {"kvTierSalt": SALT}, "config": {"kvTiers": TIERS}}
    settings, env = _settings(values, monkeypatch)
    assert settings.kv_tier_host_gib == 2.5 and settings.kv_tier_disk_gib == 4
    assert settings.kv_tier_disk_path == "/data/kv-tiers"
    assert settings.kv_tier_shared_url == TIERS["sharedUrl"]
    assert settings.kv_tier_ttl_s == 3600
    # The salt is a secret: in the Secret, never in the ConfigMap.
    assert settings.kv_tier_salt == SALT
    configmap = kinds(render(values))["ConfigMap"][0]["data"]
    assert SALT not in str(configmap)


def test_an_existing_secret_may_carry_the_salt():
    kinds_ = kinds(render({"secrets": {"existingSecret": "creds"}}))
    c = kinds_["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    ref = next(e for e in c["env"] if e["name"] == "LORAPLEX_KV_TIER_SALT")
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "creds", "key": "kv-tier-salt",
                                                "optional": True}  # fmt: skip


def test_helm_refuses_bad_tier_values():
    for bad, field in (
        ({"sharedUrl": "http://redis:6379"}, "sharedUrl"),
        ({"hostGib": -1}, "hostGib"),
        ({"diskPath": "relative/dir"}, "diskPath"),
        ({"ttlSeconds": 1.5}, "ttlSeconds"),
        ({"hostGiB": 1}, "hostGiB"),  # a typo is refused, not ignored
    ):
        values = {"secrets": {"existingSecret": "x"}, "config": {"kvTiers": bad}}
        assert field in template_error(values), bad


def test_a_redis_password_travels_in_the_secret(monkeypatch):
    url = "redis://:Hq3mZx8Lw2@kv-redis.serving:6379/0"
    values = {
        "secrets": SECRETS | {"kvTierSharedUrl": url},
        "config": {"kvTiers": {"sharedUrl": "redis://ignored:6379/0"}},
    }
    settings, _ = _settings(values, monkeypatch)
    assert settings.kv_tier_shared_url == url  # the Secret's wins, as env over envFrom
    assert "Hq3mZx8Lw2" not in str(kinds(render(values))["ConfigMap"][0]["data"])
