"""The chart's alerts, as Prometheus runs them: the rendered PrometheusRule passes `promtool
check rules` (PromQL and the annotations' templates), and `promtool test rules` replays
series, healthy and then each failure, through Prometheus' own rule engine: each alert fires
for its failure (after its `for`), with the labels it is routed by, and no alert fires on a
healthy replica."""

from __future__ import annotations

import copy
import subprocess

import yaml

from tests.helm.chart import SECRETS, kinds, promtool, render

VALUES = {"secrets": SECRETS, "metrics": {"prometheusRule": {"enabled": True}}}
# The labels the default selector reads: a ServiceMonitor's targets of release "prod" in
# namespace "serving" (tests/helm/chart.py renders that release).
TARGET = {"job": "prod-loraplex", "namespace": "serving"}
ALERTS = (
    "LoraplexHighErrorRate",
    "LoraplexHighTimeToFirstToken",
    "LoraplexQueueGrowing",
    "LoraplexKVCacheSaturated",
    "LoraplexAdapterLoadFailures",
    "LoraplexEngineDown",
)


def _series(name: str, values: str, **labels: str) -> dict:
    all_labels = {**TARGET, "instance": "a", **labels}
    inner = ",".join(f'{k}="{v}"' for k, v in all_labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


TTFT = "loraplex_time_to_first_token_seconds_bucket"
# One replica serving well for an hour, at one-minute steps: 60 requests a minute, one of
# them failing; every first token under half a second; a short steady queue; KV 60% used.
HEALTHY = {
    "up": _series("up", "1x60"),
    "loaded": _series("loraplex_model_loaded", "1x60"),
    "ok": _series("loraplex_requests_total", "0+60x60", route="completions", status="ok"),
    "error": _series("loraplex_requests_total", "0+1x60", route="completions", status="error"),
    "ttft_fast": _series(TTFT, "0+60x60", le="0.5"),
    "ttft_mid": _series(TTFT, "0+60x60", le="2.5"),
    "ttft_all": _series(TTFT, "0+60x60", le="+Inf"),
    "waiting": _series("loraplex_waiting_requests", "3x60"),
    "kv": _series("loraplex_kv_cache_usage_ratio", "0.6x60"),
    "load_failures": _series("loraplex_adapter_load_failures", "0x60"),
}
FIRING = {"severity": "critical"}
WARNING = {"severity": "warning"}
REPLICA = {**TARGET, "instance": "a"}

# (what goes wrong: series replaced or dropped, when to look, the alert, labels it fires with)
FAILURES = [
    ("errors", {"error": "0+10x60"}, "30m", "LoraplexHighErrorRate", FIRING),
    (
        "slow first tokens",  # nearly every first token past 2.5 s
        {"ttft_fast": "0+1x60", "ttft_mid": "0+1x60"},
        "30m",
        "LoraplexHighTimeToFirstToken",
        WARNING,
    ),
    ("growing queue", {"waiting": "0+1x60"}, "50m", "LoraplexQueueGrowing", WARNING),
    (
        "full KV cache",
        {"kv": "0.97x60"},
        "30m",
        "LoraplexKVCacheSaturated",
        {"instance": "a", **WARNING},
    ),  # fmt: skip
    (
        "adapter loads fail",
        {"load_failures": "0x20 1x39"},
        "25m",
        "LoraplexAdapterLoadFailures",
        {"instance": "a", **WARNING},
    ),  # fmt: skip
    ("replica not scraped", {"up": "0x60"}, "30m", "LoraplexEngineDown", {**REPLICA, **FIRING}),
    (
        "model never loads",
        {"loaded": "0x60"},
        "30m",
        "LoraplexEngineDown",
        {**REPLICA, **FIRING},
    ),  # fmt: skip
    # No target left at all (or a selector that matches none): absent() still says so.
    ("no replica scraped", {"up": None}, "30m", "LoraplexEngineDown", {**TARGET, **FIRING}),
]


def _rules_file(tmp_path, *, annotations: bool) -> str:
    (rule,) = kinds(render(VALUES))["PrometheusRule"]
    groups = copy.deepcopy(rule["spec"]["groups"])
    if not annotations:  # their text is Prometheus templating: checked by `check rules`
        for group in groups:
            for r in group["rules"]:
                r.pop("annotations", None)
    path = tmp_path / ("rules.yaml" if annotations else "rules-bare.yaml")
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path.name


def _promtool(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool(), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_promtool_accepts_the_rules(tmp_path):
    out = _promtool(tmp_path, "check", "rules", _rules_file(tmp_path, annotations=True))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def _case(changes: dict, checks: list[dict]) -> dict:
    series = dict(HEALTHY)
    for key, values in changes.items():
        if values is None:
            del series[key]
        else:
            series[key] = {**series[key], "values": values}
    return {"interval": "1m", "input_series": list(series.values()), "alert_rule_test": checks}


def test_each_alert_fires_for_its_failure_and_none_when_healthy(tmp_path):
    rules = _rules_file(tmp_path, annotations=False)
    healthy = [{"eval_time": "55m", "alertname": a, "exp_alerts": []} for a in ALERTS]
    cases = [_case({}, healthy)]
    for _, changes, when, alert, labels in FAILURES:
        cases.append(_case(changes, [{"eval_time": when, "alertname": alert,
                                      "exp_alerts": [{"exp_labels": labels}]}]))  # fmt: skip
    # `for` holds an alert back: the full KV cache has not yet lasted its 15 minutes at 10m.
    cases.append(_case({"kv": "0.97x60"}, [
        {"eval_time": "10m", "alertname": "LoraplexKVCacheSaturated", "exp_alerts": []},
    ]))  # fmt: skip
    (tmp_path / "alerts-test.yaml").write_text(
        yaml.safe_dump({"rule_files": [rules], "evaluation_interval": "1m", "tests": cases})
    )
    out = _promtool(tmp_path, "test", "rules", "alerts-test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_the_replay_catches_an_alert_that_would_not_fire(tmp_path):
    """The replay can fail: a threshold raised past what the failure reaches stays silent."""
    values = copy.deepcopy(VALUES)
    values["metrics"]["prometheusRule"]["errorRatio"] = 0.5
    (rule,) = kinds(render(values))["PrometheusRule"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    errors = _case({"error": "0+10x60"}, [{"eval_time": "30m", "alertname": ALERTS[0],
                                           "exp_alerts": [{"exp_labels": FIRING}]}])  # fmt: skip
    (tmp_path / "t.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": [errors]})
    )
    out = _promtool(tmp_path, "test", "rules", "t.yaml")
    assert out.returncode != 0 and "LoraplexHighErrorRate" in out.stdout + out.stderr
