"""Every runnable block of README.md and docs/*.md, run as a reader would paste it, against one
live server (tests/docs/conftest.py), and checked against what its page shows (runner.py).

Each block runs as a fresh tenant whose key stands in for the page's `lpx_...`; the server's
address stands in for `http://127.0.0.1:8000` and `http://localhost:8000`. A block's marker
(docs/README.md) names the state it starts from (`setup=`), its tenant's name (`tenant=`), or
why it does not run here (`skip (...)`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.platform.logs import PlainFormatter
from testkit.factories import make_adapter
from tests.docs import runner
from tests.docs.blocks import Block, all_blocks
from tests.docs.conftest import OUTCOMES, DocsServer
from tests.utils.uploads import auth

BLOCKS = [b for b in all_blocks() if b.runnable]
# What a Python block gets of the environment shell blocks run with (conftest.py).
_BLOCK_ENV = ("LORAPLEX_DATA_DIR", "LORAPLEX_DATABASE_URL", "LORAPLEX_ADMIN_KEY", "URL",
              "ADMIN_KEY")  # fmt: skip


def _sql_split(docs: DocsServer, key: str, subs: dict[str, str]) -> None:
    docs.upload(key, "sql", "qv4")
    docs.upload(key, "sql", "attn8")
    docs.alias(key, "sql", "default", {"weights": {"v1": 90, "v2": 10}})


def _sql_canary(docs: DocsServer, key: str, subs: dict[str, str]) -> None:
    _sql_split(docs, key, subs)
    docs.alias(key, "sql", "canary", {"version": "v2"})


def _sql_traffic(docs: DocsServer, key: str, subs: dict[str, str]) -> None:
    """Requests the ledger keeps: sql@v1 three times, sql@v2 once, 8 tokens each."""
    for model in ("sql@v1", "sql@v1", "sql@v1", "sql@v2"):
        body = {"model": model, "prompt": "SELECT", "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(f"{docs.url}/v1/completions", headers=auth(key), json=body, timeout=60)
        assert r.status_code == 200, r.text


def _my_adapter(docs: DocsServer, key: str, subs: dict[str, str]) -> None:
    docs.upload(key, "my-adapter", "qv4")


def _demo_model(docs: DocsServer, key: str, subs: dict[str, str]) -> None:
    """`model="demo"` finds the converted demo model in the data dir, as `serve` leaves it;
    `/path/to/peft-adapter` is a PEFT adapter of it."""
    assert docs.request is not None
    model = docs.request.getfixturevalue("demo_model_dir")
    link = Path(docs.server.settings.data_dir) / "models" / model.name
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(model, target_is_directory=True)
    if docs.demo_adapter is None:
        docs.demo_adapter = make_adapter(model, docs.root / "demo-adapter", r=8, alpha=16)
    subs["/path/to/peft-adapter"] = str(docs.demo_adapter)


# The states a block can start from (`setup=NAME`), on its fresh tenant.
SETUPS: dict[str, Callable[[DocsServer, str, dict[str, str]], None]] = {
    "sql-split": _sql_split,  # sql v1 and v2, `default` split v1 90 / v2 10
    "sql-canary": _sql_canary,  # the same, and alias `canary` on v2
    "sql-traffic": _sql_traffic,  # after sql-split: 3 requests to sql@v1, 1 to sql@v2
    "my-adapter": _my_adapter,  # an adapter named my-adapter
    "demo-model": _demo_model,  # the demo model, and a PEFT adapter of it
}


def _write_files(docs: DocsServer, page: Path, folder: Path) -> None:
    """The page's data blocks marked `file=PATH`, as files in its folder: a `json` block is
    JSON Lines, one value a line (a page may wrap a line for reading)."""
    for block in (b for b in all_blocks() if b.page == page and b.marker.file):
        text = block.text
        if block.lang == "json":
            decoder, values, rest = json.JSONDecoder(), [], text.strip()
            while rest:
                value, end = decoder.raw_decode(rest)
                values.append(json.dumps(value))
                rest = rest[end:].strip()
            text = "\n".join(values) + "\n"
        (folder / block.marker.file).write_text(text)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs_as_its_page_shows(block: Block, docs_server: DocsServer) -> None:
    if block.marker.skip:
        OUTCOMES.append((block.id, block.marker.skip))
        pytest.skip(block.marker.skip)
    unknown = set(block.marker.setup) - SETUPS.keys()
    assert not unknown, f"{block.id}: no setup named {unknown} (tests/docs/test_docs_run.py)"
    folder = docs_server.page_dir(block.page)
    _write_files(docs_server, block.page, folder)
    _, key, _ = docs_server.tenant(block.marker.tenant)
    subs = {
        "lpx_...": key,
        "http://127.0.0.1:8000": docs_server.url,
        "http://localhost:8000": docs_server.url,
    }
    for name in block.marker.setup:
        SETUPS[name](docs_server, key, subs)
    text = block.text
    for placeholder, value in subs.items():
        text = text.replace(placeholder, value)
    env = docs_server.env()
    if block.lang == "console":
        runner.run_console(text, folder, env)
    elif block.lang == "python":
        # This process's settings stay (tests/conftest.py's); the server's come over them.
        runner.run_python(text, folder, {k: env[k] for k in _BLOCK_ENV}, block.id)
    else:
        runner.run_shell(text, folder, env)
    OUTCOMES.append((block.id, None))


def test_every_405_names_the_methods_served(docs_server: DocsServer) -> None:
    """docs/security.md: every 405 carries the `Allow` header, naming each method the path
    serves, for every path of the published API."""
    document = httpx.get(f"{docs_server.url}/openapi.json").json()
    _, key, _ = docs_server.tenant(None)
    tried = 0
    for path, operations in document["paths"].items():
        served = {m.upper() for m in operations}
        url = docs_server.url + path.replace("{", "").replace("}", "")
        for method in {"GET", "POST", "PUT", "PATCH", "DELETE"} - served:
            r = httpx.request(method, url, headers=auth(key))
            assert r.status_code == 405, (method, path, r.text)
            assert r.json()["error"]["code"] == "method_not_allowed"
            allow = set(r.headers["allow"].split(", ")) - {"HEAD"}
            assert allow == served, (method, path, r.headers["allow"])
            tried += 1
    assert tried > 20


def test_metrics_name_no_tenant(docs_server: DocsServer) -> None:
    """docs/security.md and docs/observability.md: `/metrics` carries no tenant name or id;
    which version answered is there by served name and version. After the blocks above, the
    server has answered adapter requests of several tenants."""
    tenant_id, key, name = docs_server.tenant(None)
    _sql_split(docs_server, key, {})
    body = {"model": "sql@v2", "prompt": "SELECT", "max_tokens": 2}
    r = httpx.post(f"{docs_server.url}/v1/completions", headers=auth(key), json=body, timeout=60)
    assert r.status_code == 200, r.text
    families = list(text_string_to_metric_families(httpx.get(f"{docs_server.url}/metrics").text))
    labels = {label for f in families for s in f.samples for label in s.labels}
    assert not {label for label in labels if "tenant" in label}, labels
    values = {v for f in families for s in f.samples for v in s.labels.values()}
    assert name not in values
    versions = [
        s.labels
        for f in families
        if f.name == "loraplex_adapter_version_requests"
        for s in f.samples
        if s.name.endswith("_total")
    ]
    assert {"adapter": "sql", "version": "v2"} in versions


def test_the_request_log_line_says_what_security_md_lists(docs_server: DocsServer) -> None:
    """docs/security.md: one line per request with its id, tenant, model, status and token
    counts, in the default (plain) logs."""
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Lines()
    handler.setFormatter(PlainFormatter())
    logger = logging.getLogger("loraplex.requests")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        tenant_id, key, _ = docs_server.tenant(None)
        # A tenant without adapters is offered the base model alone.
        (base,) = httpx.get(f"{docs_server.url}/v1/models", headers=auth(key)).json()["data"]
        body = {"model": base["id"], "prompt": "Hello", "max_tokens": 3}
        r = httpx.post(f"{docs_server.url}/v1/completions", headers=auth(key), json=body,
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    usage = r.json()["usage"]
    (line,) = [line for line in lines if f"request_id={r.json()['id']}" in line]
    assert "request finished" in line and "\n" not in line
    for field in (f"tenant_id={tenant_id}", "status=ok",
                  f"prompt_tokens={usage['prompt_tokens']}",
                  f"completion_tokens={usage['completion_tokens']}"):  # fmt: skip
        assert f" {field} " in f"{line} ", (field, line, r.text)
    assert " model=" in line
