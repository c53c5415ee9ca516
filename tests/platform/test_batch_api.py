"""The Batch API end to end with the unmodified `openai` client against a real server: upload,
create, poll, download; lines naming adapters answer as the interactive routes do (greedy, the
same text); bad lines fail alone in the error file; cancel; another tenant sees nothing; the
ledger bills each line once, as batch usage."""

from __future__ import annotations

import json
import secrets
import time

import httpx
import openai
import pytest
from sqlalchemy import select

from loraplex.platform.db.models import UsageRecord
from tests.utils.server import ADMIN_KEY, run_server, upload_adapter


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(
        tiny_models["llama"],
        tmp_path_factory.mktemp("batches"),
        batch_poll_interval_s=0.1,
        batch_concurrency=4,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def tenant(server, tiny_adapters):
    _, key = server.new_tenant(f"batch-{secrets.token_hex(3)}")
    for name in ("qv4", "mlp16"):
        r = upload_adapter(server.url, key, name, tiny_adapters["llama"][name])
        assert r.status_code == 201, r.text
    return key


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def jsonl(items: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in items).encode()


def wait(c: openai.OpenAI, batch_id: str, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.2)


def lines_of(c: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    rows = [json.loads(x) for x in c.files.content(file_id).text.splitlines()]
    by_id = {r["custom_id"]: r for r in rows}
    assert len(by_id) == len(rows), "a custom_id answered twice"
    return by_id


def test_the_openai_client_runs_a_batch_with_adapters(server, tenant):
    c = client(server, tenant)
    base = server.state.model_name
    models = [base, "qv4", "mlp16"]
    items = [
        {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": models[i % 3], "max_tokens": 6, "temperature": 0,
                  "messages": [{"role": "user", "content": f"count to {i}"}]}}
        for i in range(9)
    ]  # fmt: skip
    items.append(
        {
            "custom_id": "no-such-adapter",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        }
    )
    items.append({"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": base, "messages": "not a list"}})  # fmt: skip
    f = c.files.create(file=("in.jsonl", jsonl(items)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h", metadata={"job": "eval"})  # fmt: skip
    assert b.status == "validating" and b.metadata == {"job": "eval"}
    b = wait(c, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (
        11, 9, 2)  # fmt: skip
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    out, err = lines_of(c, b.output_file_id), lines_of(c, b.error_file_id)
    assert set(out) == {f"chat-{i}" for i in range(9)}
    assert set(err) == {"no-such-adapter", "bad-body"}
    assert err["no-such-adapter"]["response"]["status_code"] == 404
    assert err["no-such-adapter"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert err["bad-body"]["response"]["status_code"] == 400
    assert "messages" in err["bad-body"]["response"]["body"]["error"]["message"]
    # Each answer is the interactive route's answer to the same body (greedy decoding).
    for item in items[:9]:
        line = out[item["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == item["body"]["model"]
        direct = c.chat.completions.create(**item["body"])
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert line["response"]["request_id"] == body["id"]
    # The ledger: one batch record per line that ran, with the tokens its answer reports.
    with server.sessions() as session:
        rows = session.scalars(
            select(UsageRecord).where(UsageRecord.request_id.like(f"{b.id}-%"))
        ).all()
    assert len(rows) == 9 and {r.request_class for r in rows} == {"batch"}
    tokens = {r.request_id: r.completion_tokens for r in rows}
    for line in out.values():
        body = line["response"]["body"]
        assert tokens[body["id"]] == body["usage"]["completion_tokens"]
    assert {x.id for x in c.batches.list().data} >= {b.id}


def _counts(server) -> tuple[float | None, ...]:
    get = server.state.metrics.registry.get_sample_value
    return tuple(get(f"loraplex_{name}_count") for name in (
        "time_to_first_token_seconds", "request_latency_seconds",
        "batch_request_latency_seconds"))  # fmt: skip


def test_completions_endpoint_and_a_line_for_the_wrong_endpoint(server, tenant):
    c = client(server, tenant)
    good = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "qv4", "prompt": f"once upon {i}", "max_tokens": 3}}
            for i in range(3)]  # fmt: skip
    f = c.files.create(file=("c.jsonl", jsonl(good)), purpose="batch")
    ttft, latency, batch = _counts(server)
    b = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                 completion_window="24h").id)  # fmt: skip
    assert b.status == "completed" and b.request_counts.completed == 3
    # The interactive latency histograms (what alerts read) never see a batch line.
    assert _counts(server) == (ttft, latency, (batch or 0) + 3)
    with pytest.raises(openai.ConflictError, match="completed"):
        c.batches.cancel(b.id)
    assert all(x["response"]["body"]["object"] == "text_completion"
               for x in lines_of(c, b.output_file_id).values())  # fmt: skip
    # The same file under the chat endpoint fails validation, naming the line.
    b = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id)  # fmt: skip
    assert b.status == "failed" and b.errors.data[0].line == 1
    assert "endpoint" in b.errors.data[0].message


def test_create_refusals(server, tenant):
    c = client(server, tenant)
    f = c.files.create(file=("x.jsonl", jsonl([{"custom_id": "a", "method": "POST",
                       "url": "/v1/completions", "body": {"model": "qv4", "prompt": "x"}}])),
                       purpose="batch")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                         completion_window="24h")  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_nope")


def test_a_spent_batch_budget_holds_the_lines(server):
    """batch_tokens_per_month spent: the lines wait (for next month) instead of running or
    failing; the tenant's interactive requests still run; a cancel ends the wait."""
    tid, key = server.new_tenant(f"budget-{secrets.token_hex(3)}")
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    url = f"{server.url}/admin/api/tenants/{tid}/quota"
    put = httpx.put(url, json={"batch_tokens_per_month": 0}, headers=admin)
    assert put.status_code == 200, put.text
    assert httpx.get(url, headers=admin).json()["batch_tokens_per_month"] == 0
    c, model = client(server, key), server.state.model_name
    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": "hi", "max_tokens": 2}}  # fmt: skip
    f = c.files.create(file=("b.jsonl", jsonl([line])), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while c.batches.retrieve(b.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert c.completions.create(model=model, prompt="hi", max_tokens=2).usage
    assert c.batches.retrieve(b.id).request_counts.completed == 0
    c.batches.cancel(b.id)
    b = wait(c, b.id)
    assert b.status == "cancelled" and b.request_counts.completed == b.request_counts.failed == 0


def test_cancel_keeps_what_finished_and_another_tenant_sees_nothing(server, tenant):
    c = client(server, tenant)
    items = [
        {
            "custom_id": f"l{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "qv4", "prompt": f"story {i}", "max_tokens": 40, "ignore_eos": True},
        }
        for i in range(400)
    ]  # fmt: skip  (a cancel reaches running lines within 2 s)
    f = c.files.create(file=("long.jsonl", jsonl(items)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    _, other_key = server.new_tenant(f"other-{secrets.token_hex(3)}")
    other = client(server, other_key)
    for call in (other.batches.retrieve, other.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(b.id)
    assert other.batches.list().data == []
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 60
    while c.batches.retrieve(b.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with pytest.raises(openai.ConflictError, match="still running"):
        c.files.delete(f.id)
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    b = wait(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    done = b.request_counts.completed
    assert 2 <= done < 400
    assert len(lines_of(c, b.output_file_id)) == done
    assert c.batches.cancel(b.id).status == "cancelled"  # again: no change
    assert c.files.delete(f.id).deleted


def test_cli_submits_and_downloads(server, tenant, tmp_path, monkeypatch, capsys):
    import argparse

    from loraplex.platform import cli_batches

    parser = argparse.ArgumentParser()
    cli_batches.add_parser(parser.add_subparsers(dest="cmd"))

    def cli(*argv: str) -> str:
        args = parser.parse_args(["batches", *argv])
        assert args.func(args) == 0
        return capsys.readouterr().out

    monkeypatch.setenv("LORAPLEX_API_KEY", tenant)
    requests = tmp_path / "r.jsonl"
    requests.write_bytes(jsonl([{"custom_id": f"k{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "qv4", "prompt": "hi", "max_tokens": 2}}
                                for i in range(2)]))  # fmt: skip
    out = cli("submit", str(requests), "--endpoint", "/v1/completions", "--url", server.url,
              "--metadata", "team=eval")  # fmt: skip
    batch_id = out.split()[0]
    wait(client(server, tenant), batch_id)
    assert "completed" in cli("status", batch_id, "--url", server.url)
    dest = tmp_path / "o.jsonl"
    cli("download", batch_id, "--url", server.url, "--output", str(dest))
    assert sorted(json.loads(x)["custom_id"] for x in dest.read_text().splitlines()) == [
        "k0", "k1"]  # fmt: skip
    # The admin's price factor, on the database.
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", server.settings.database_url)
    with server.sessions() as session:
        from loraplex.platform.db.models import Batch, Tenant

        name = session.get(Tenant, session.get(Batch, batch_id).tenant_id).name
    assert "0.25" in cli("price-factor", name, "0.25")
    with server.sessions() as session:
        assert str(session.get(Tenant, session.get(Batch, batch_id).tenant_id).batch_price_factor) \
            == "0.2500"  # fmt: skip


# Enough work that the server goes down mid-batch even on a fast machine (two lines at once).
LINES = 24


def test_a_server_shutting_down_lets_its_running_lines_finish(tiny_models, tmp_path):
    from loraplex.platform.db.models import Batch, BatchLine

    with run_server(tiny_models["llama"], tmp_path, batch_poll_interval_s=0.1,
                    batch_concurrency=2) as srv:  # fmt: skip
        _, key = srv.new_tenant("drain")
        c = client(srv, key)
        items = [{"custom_id": f"d{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": srv.state.model_name, "prompt": f"go {i}",
                           "max_tokens": 64, "ignore_eos": True}}
                 for i in range(LINES)]  # fmt: skip
        f = c.files.create(file=("d.jsonl", jsonl(items)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")  # fmt: skip
        deadline = time.monotonic() + 60
        while c.batches.retrieve(b.id).request_counts.completed < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sessions = srv.sessions
    # The server is down: each line it started finished and has its answer; the batch waits,
    # lease given back, for a server to go on with it.
    with sessions() as session:
        done = set(session.scalars(select(BatchLine.line).where(BatchLine.batch_id == b.id)))
        billed = session.scalars(
            select(UsageRecord).where(UsageRecord.request_id.like(f"{b.id}-%"))
        ).all()
        row = session.get(Batch, b.id)
        assert (row.status, row.runner) == ("in_progress", None)
    assert 1 <= len(done) < LINES
    assert {r.request_id for r in billed} == {f"{b.id}-{i}" for i in done}
    assert {r.status for r in billed} == {"ok"}
