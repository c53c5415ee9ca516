"""benchmarks/dataplane_stages.py: a py-spy sample goes to the stage of its innermost frame
that names a stage's code; waiting threads are not counted."""

from __future__ import annotations

from benchmarks.dataplane_stages import LOOP, STAGES, split_samples, stage_of

ROOT = ["<module> (/x/loraplex/platform/cli.py:1)", "run (/x/site-packages/uvicorn/main.py:9)",
        "BaseEventLoop._run_once (/x/asyncio/base_events.py:1907)",
        "Handle._run (/x/asyncio/events.py:80)"]  # fmt: skip
STAGE = {name.split(" (")[0]: name for name, _ in STAGES}


def test_the_innermost_frame_that_names_a_stage_decides():
    read = [*ROOT, "VllmDataPlane._read (/x/platform/dataplane/vllm.py:350)",
            "loads (/x/json/__init__.py:346)"]  # fmt: skip
    assert stage_of(read) == STAGE["upstream call"]
    # The same database call, under the key check and under the usage record.
    sql = "DefaultDialect.do_execute (/x/site-packages/sqlalchemy/engine/default.py:1192)"
    key = [*ROOT, "current_caller (/x/platform/api/deps.py:53)",
           "authenticate (/x/platform/db/crud.py:190)", sql]  # fmt: skip
    usage = ["_worker (/x/concurrent/futures/thread.py:83)",
             "record_usage (/x/platform/usage.py:55)", sql]  # fmt: skip
    assert stage_of(key) == STAGE["auth"]
    assert stage_of(usage) == STAGE["metering"]
    # asyncio's own work between callbacks is the loop's, not the HTTP server's at the root.
    assert stage_of([*ROOT, "Task.__step (/x/asyncio/tasks.py:267)"]) == LOOP


def test_waiting_threads_are_not_counted():
    raw = "\n".join([
        ";".join([*ROOT[:3], "EpollSelector.select (/x/selectors.py:468)"]) + " 50",
        "_bootstrap (/x/threading.py:1);_worker (/x/concurrent/futures/thread.py:81) 30",
        ";".join([*ROOT, "CompletionStream.chunks (/x/platform/openai/completions.py:202)"])
        + " 7",
    ])  # fmt: skip
    counts, leaves = split_samples(raw)
    assert counts == {STAGE["SSE re-encoding"]: 7}
    assert sum(leaves[STAGE["SSE re-encoding"]].values()) == 7
