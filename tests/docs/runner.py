"""Run one block of a page against the docs server and check what the page shows of its result.

- shell (`sh`, `bash`, `shell`): the block runs as one bash script, command by command; every
  command must exit 0, every `curl` answer must be 2xx unless the page shows its status, and
  an output the page shows in a comment under a command (`# {...}`, `# 409 {...}`, continued
  on `#  ` lines) must match the answer: the same JSON, where `"..."` stands for any value
  and an object may hold more keys than shown.
- `console`: each `$ command` runs (stdout and stderr together); its output must be the lines
  shown, except in table columns whose values differ from run to run (digests, sizes, times).
- `python`: the block runs as a script (in this process, a namespace of its own) and must not
  raise.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 180
# Columns of the CLI's tables that hold what differs from run to run: digests, sizes, times.
VOLATILE_COLUMNS = {"SHA256", "BYTES", "CREATED", "LAST USED", "UPDATED"}
EXPECTED = re.compile(r"^#\s?(?:(\d{3})\s*)?([\[{].*)$")


@dataclass
class Step:
    command: str
    status: int | None = None  # the HTTP status the page shows under it
    output: str | None = None  # the JSON the page shows under it


def shell_steps(text: str) -> list[Step]:
    steps: list[Step] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            i += 1
            continue
        if stripped.startswith("#"):
            shown = EXPECTED.match(stripped)
            follows_command = steps and steps[-1].output is None and lines[i - 1].strip()
            if shown and follows_command and not lines[i - 1].strip().startswith("#"):
                parts = [shown.group(2)]
                while i + 1 < len(lines) and re.match(r"^\s*#\s{2,}\S", lines[i + 1]):
                    i += 1
                    parts.append(lines[i].strip()[1:].strip())
                steps[-1].output = " ".join(parts)
                steps[-1].status = int(shown.group(1)) if shown.group(1) else None
            i += 1
            continue
        command = [line]
        while command[-1].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            command.append(lines[i])
        steps.append(Step("\n".join(command)))
        i += 1
    return steps


def _script(steps: list[Step]) -> str:
    # Each answer's status goes to stderr, so stdout stays what the page shows.
    out = ["curl() { command curl -w '%{stderr}@@status %{http_code}@@\\n' \"$@\"; }"]
    for n, step in enumerate(steps):
        out.append(f"printf '\\n@@step {n}@@\\n'; printf '\\n@@step {n}@@\\n' >&2")
        out.append(step.command)
        out.append("printf '@@rc %d@@\\n' $? >&2")
    return "\n".join(out) + "\n"


def _split(text: str) -> dict[int, str]:
    parts = re.split(r"\n@@step (\d+)@@\n", "\n" + text)
    return {int(parts[k]): parts[k + 1] for k in range(1, len(parts) - 1, 2)}


def matches(shown, actual) -> bool:
    if shown == "...":
        return True
    if isinstance(shown, dict):
        return isinstance(actual, dict) and all(
            k in actual and matches(v, actual[k]) for k, v in shown.items()
        )
    if isinstance(shown, list):
        return (
            isinstance(actual, list)
            and len(shown) == len(actual)
            and all(matches(s, a) for s, a in zip(shown, actual, strict=True))
        )
    return shown == actual


def run_shell(text: str, cwd: Path, env: dict[str, str]) -> None:
    steps = shell_steps(text)
    done = subprocess.run(["bash", "-c", _script(steps)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)  # fmt: skip
    outs, errs = _split(done.stdout), _split(done.stderr)
    for n, step in enumerate(steps):
        out, err = outs.get(n, ""), errs.get(n, "")
        what = f"`{step.command}` said:\n{out}\n{err}"
        rc = re.search(r"@@rc (\d+)@@", err)
        assert rc is not None and rc.group(1) == "0", f"exit status {rc and rc.group(1)}: {what}"
        statuses = [int(s) for s in re.findall(r"@@status (\d+)@@", err)]
        if step.status is not None:
            assert statuses == [step.status], f"the page shows {step.status}: {what}"
        else:
            assert all(200 <= s < 300 for s in statuses), what
        if step.output is not None:
            shown = json.loads(step.output)
            body = re.sub(r"@@status \d+@@", "", out).strip()
            assert matches(shown, json.loads(body)), f"the page shows {step.output}: {what}"


def _cells(header: str, row: str) -> dict[str, str]:
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=\s\s))\S", header)]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    cells = [row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return dict(zip(names, cells, strict=True))


def same_output(shown: list[str], actual: list[str]) -> bool:
    """The lines match, table rows cell by cell under their own headers, volatile columns
    aside. A table is a line of capitals (`TENANT  NAME ...`) and the lines below it."""
    if len(shown) != len(actual):
        return False
    headers: tuple[str, str] | None = None
    for s, a in zip(shown, actual, strict=True):
        if not s.strip():
            headers = None
            if a.strip():
                return False
        elif re.fullmatch(r"[A-Z][A-Z0-9 /]*", s.strip()) and "  " in s.strip():
            headers = (s, a)
            if s.split() != a.split():
                return False
        elif headers is not None:
            shown_cells, actual_cells = _cells(headers[0], s), _cells(headers[1], a)
            for name, value in shown_cells.items():
                if name not in VOLATILE_COLUMNS and actual_cells.get(name) != value:
                    return False
        elif s.rstrip() != a.rstrip():
            return False
    return True


def run_console(text: str, cwd: Path, env: dict[str, str]) -> None:
    commands: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
    assert commands, "a console block shows `$ command` lines"
    for command, shown in commands:
        while shown and not shown[-1].strip():
            shown.pop()
        done = subprocess.run(["bash", "-c", f"exec 2>&1\n{command}"], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
        actual = done.stdout.rstrip("\n").splitlines()
        assert same_output(shown, actual), (
            f"`{command}`: the page shows\n" + "\n".join(shown) + "\nbut it said\n" + done.stdout
        )


def _too_long(signum, frame) -> None:
    raise TimeoutError(f"the block ran past {TIMEOUT_S} s")


def run_python(text: str, cwd: Path, env: dict[str, str], name: str) -> None:
    """Run the block in this process (its imports are the block's own: a fresh namespace),
    from the page's folder, with `env` over this process's environment for the run: the
    interpreter and torch are loaded once for every block, not once a block."""
    code = compile(text, name, "exec")
    saved_env, saved_cwd = dict(os.environ), Path.cwd()
    namespace: dict = {"__name__": "__main__"}
    os.environ.update(env)
    os.chdir(cwd)
    # A block that never ends (a batch that never completes) fails instead of hanging CI.
    previous = signal.signal(signal.SIGALRM, _too_long)
    signal.alarm(TIMEOUT_S)
    try:
        exec(code, namespace)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        namespace.clear()  # an LLM the block made goes now, not at the session's end
        gc.collect()
