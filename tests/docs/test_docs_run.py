"""Every runnable block of README.md and docs/*.md, run as a reader would paste it, against one
live server (tests/docs/conftest.py), and checked against what its page shows (runner.py).

Each block runs as a fresh tenant whose key stands in for the page's `lpx_...`; the server's
address stands in for `http://127.0.0.1:8000` and `http://localhost:8000`. A block's marker
(docs/README.md) names the state it starts from (`setup=`), its tenant's name (`tenant=`), or
why it does not run here (`skip (...)`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.docs import runner
from tests.docs.blocks import Block, all_blocks
from tests.docs.conftest import OUTCOMES, DocsServer
from tests.utils.factories import make_adapter
from tests.utils.uploads import auth

BLOCKS = [b for b in all_blocks() if b.runnable]


def _sql_split(docs: DocsServer, key: str, subs: dict[str, str]) -> None:
    docs.upload(key, "sql", "qv4")
    docs.upload(key, "sql", "attn8")
    docs.alias(key, "sql", "default", {"weights": {"v1": 90, "v2": 10}})


def _sql_canary(docs: DocsServer, key: str, subs: dict[str, str]) -> None:
    _sql_split(docs, key, subs)
    docs.alias(key, "sql", "canary", {"version": "v2"})


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
        runner.run_python(text, folder, env, sys.executable, f"block_{block.line}")
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
