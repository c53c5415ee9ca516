"""guidellm, the load generator people point at vLLM, run unchanged against the server: the
token counts in its report equal the usage ledger, request by request and in total."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoTokenizer

from testkit.venvs import client_env, run
from tests.clients.conftest import ADAPTER

PROMPT_TOKENS, OUTPUT_TOKENS = 32, 16


@pytest.fixture(scope="module")
def guidellm(client_bins, clients_server):  # the server starts while pip installs
    return client_bins["guidellm"].result() / "guidellm"


def run_guidellm(guidellm, tenant, tmp_path, *, profile: str, request_format: str, n: int):
    """One `guidellm run` as its README shows it; the key through its settings' env var."""
    report = tmp_path / "benchmarks.json"
    backend = f"kind=openai_http,target={tenant.url},model={ADAPTER}"
    data = f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"
    run(
        [guidellm, "run", "--backend", f"{backend},request_format={request_format}",
         "--profile", profile, "--constraint", f"kind=max_requests,count={n}", "--data", data,
         "--tokenizer", f"kind=huggingface_auto,model={tenant.model_dir}",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        timeout=300,
        cwd=tmp_path,  # it writes guidellm.log where it runs
        # One worker process (its setting): 4 streams need no more, and each costs an import
        # of torch on a machine of 2 cores.
        env=client_env(GUIDELLM__SPEC__BACKEND__API_KEY=tenant.key,
                       GUIDELLM__MAX_WORKER_PROCESSES="1"),
    )  # fmt: skip
    (bench,) = json.loads(report.read_text())["benchmarks"]
    return bench


def ledger_of(tenant, n: int) -> dict:
    """The ledger once all `n` requests are in it (a row is written as its request ends)."""
    deadline = time.monotonic() + 10
    while len(rows := tenant.ledger()) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return rows


@pytest.mark.parametrize(
    "profile, request_format, n",
    [
        ("kind=synchronous", "/v1/completions", 4),
        ("kind=concurrent,streams=4", "/v1/chat/completions", 8),
    ],
    ids=["synchronous-completions", "concurrent-chat"],
)
def test_guidellm_token_counts_equal_the_ledger(
    guidellm, new_tenant, tmp_path, profile, request_format, n
):
    tenant = new_tenant(f"guidellm-{profile.split(',')[0][5:]}")
    bench = run_guidellm(guidellm, tenant, tmp_path, profile=profile,
                         request_format=request_format, n=n)  # fmt: skip
    totals = bench["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (n, 0, 0), totals

    requests = bench["requests"]["successful"]
    ledger = ledger_of(tenant, n)
    assert sorted(ledger) == sorted(r["response_id"] for r in requests)
    tokenizer = AutoTokenizer.from_pretrained(tenant.model_dir)
    for r in requests:
        row = ledger[r["response_id"]]
        assert row.status == "ok" and row.adapter_name == ADAPTER
        assert row.prompt_tokens == r["input_metrics"]["text_tokens"], r["response_id"]
        assert row.completion_tokens == r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        body = json.loads(r["request_args"])["body"]
        if "prompt" in body:  # what the model read: the prompt as the model's tokenizer says
            assert row.prompt_tokens == len(tokenizer(body["prompt"]).input_ids)

    usage = tenant.usage()
    metrics = bench["metrics"]
    assert usage["requests"] == n
    assert usage["prompt_tokens"] == metrics["prompt_token_count"]["successful"]["total_sum"]
    assert usage["completion_tokens"] == metrics["output_token_count"]["successful"]["total_sum"]
    assert usage["completion_tokens"] == n * OUTPUT_TOKENS
