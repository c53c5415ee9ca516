"""The Python half of scripts/smoke_first_run.sh: read the README, the server's output, the
built wheel and sdist, the Dockerfile and a migrated database. Standard library only (it runs
under the system python3, outside every venv the smoke makes). Each command prints what it
found and exits non-zero, with one line saying why, when a check fails.

    readme-run README VENV          the README's run command, its `.venv` made VENV
    snippets LOG OUT                the curl line and openai snippet `serve` printed -> OUT/*.sh
    completion FILE CURL            curl's answer: choices, text, the model it named echoed
    chat FILE SNIPPET CURL          the snippet's answer as JSON: same, for the adapter it names
    dist SRC DIST                   the wheel and sdist in DIST hold every file they must
    docker DOCKERFILE CONTEXT ROOT  the Dockerfile's COPY/WORKDIR/pip RUN steps as a bash
                                    script, its absolute paths (/src, /tmp) under ROOT
    db-head DB MIGRATIONS           the SQLite file is at the newest migration
"""

from __future__ import annotations

import json
import re
import shlex
import sqlite3
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

RUN_HEADING = "## The two commands"
VENV_TOKEN = re.compile(r"(?<![\w./-])\.venv(?=[/\s]|$)")


def fail(message: str) -> None:
    sys.exit(f"smoke: FAIL: {message}")


def readme_run(readme: str, venv: str) -> None:
    """The first ```sh block under the heading, `.venv` replaced by `venv` (nothing else)."""
    lines = Path(readme).read_text().splitlines()
    if RUN_HEADING not in lines:
        fail(f"{readme} has no {RUN_HEADING!r} heading")
    rest = lines[lines.index(RUN_HEADING) + 1 :]
    try:
        start = next(i for i, line in enumerate(rest) if line.strip() == "```sh") + 1
        end = next(i for i in range(start, len(rest)) if rest[i].strip() == "```")
    except StopIteration:
        fail(f"no ```sh block under {RUN_HEADING!r} in {readme}")
    command = "\n".join(rest[start:end]).strip()
    if "loraplex serve" not in command or not VENV_TOKEN.search(command):
        fail(f"the README's run command no longer makes .venv and runs `loraplex serve`: {command}")
    print(VENV_TOKEN.sub(venv, command))


def _printed_command(lines: list[str], first: re.Pattern[str]) -> str:
    """The first line matching `first` and its backslash continuations, as printed."""
    for i, line in enumerate(lines):
        if first.search(line):
            block = [line]
            while block[-1].rstrip().endswith("\\") and i + len(block) < len(lines):
                block.append(lines[i + len(block)])
            return "\n".join(block) + "\n"
    fail(f"`serve` printed no line matching {first.pattern!r}")
    raise AssertionError


def snippets(log: str, out: str) -> None:
    lines = Path(log).read_text(errors="replace").splitlines()
    curl = _printed_command(lines, re.compile(r"^\s*curl\s"))
    snippet = _printed_command(lines, re.compile(r'\s-c\s+"from openai import'))
    suffix = ".choices[0].message.content)"
    if snippet.count(suffix) != 1:
        fail(f"the openai snippet no longer ends in {suffix!r}; update scripts/smoke_checks.py")
    out_dir = Path(out)
    (out_dir / "curl.sh").write_text(curl)
    (out_dir / "openai.sh").write_text(snippet)
    # The same call printing the whole response, to see the model it answered as.
    (out_dir / "openai_json.sh").write_text(snippet.replace(suffix, ".model_dump_json())"))
    print(f"curl line:\n{curl}openai snippet:\n{snippet}", end="")


def _answer(path: str) -> dict:
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        fail(f"not JSON: {text[:500]!r}")
    if not isinstance(doc, dict) or "error" in doc or not doc.get("choices"):
        fail(f"no choices in the answer: {text[:500]}")
    return doc


def _curl_model(curl_sh: str) -> str:
    payload = re.search(r"-d '(.*)'", Path(curl_sh).read_text())
    if not payload:
        fail("the curl line has no -d '<json>' body")
    return json.loads(payload.group(1))["model"]


def completion(path: str, curl_sh: str) -> None:
    model = _curl_model(curl_sh)
    doc = _answer(path)
    text = doc["choices"][0].get("text") or ""
    if not text.strip():
        fail(f"empty completion: {doc}")
    if doc.get("model") != model:
        fail(f"asked for model {model!r}, the answer names {doc.get('model')!r}")
    print(f"curl: model {model!r} answered {text!r}")


def chat(path: str, snippet_sh: str, curl_sh: str) -> None:
    asked = re.search(r"model='([^']+)'", Path(snippet_sh).read_text())
    if not asked:
        fail("the openai snippet names no model='…'")
    adapter = asked.group(1)
    if adapter == _curl_model(curl_sh):
        fail(f"the openai snippet asks the base model {adapter!r}, not a demo adapter")
    doc = _answer(path)
    content = (doc["choices"][0].get("message") or {}).get("content") or ""
    if not content.strip():
        fail(f"empty chat answer: {doc}")
    if doc.get("model") != adapter:
        fail(f"asked adapter {adapter!r}, the answer names {doc.get('model')!r}")
    print(f"openai: adapter {adapter!r} answered {content!r}")


def _expected(src: Path) -> dict[str, str]:
    """wheel path -> sdist path of every file the package must ship: each file in a folder
    pyproject maps (the lab, benchmarks/, is not one of them and stays in the checkout)."""
    pyproject = tomllib.loads((src / "pyproject.toml").read_text())
    files = {}
    for package, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        for path in sorted((src / folder).rglob("*")):
            rel = path.relative_to(src / folder)
            hidden = any(p.startswith(".") or p == "__pycache__" for p in rel.parts)
            if not path.is_file() or hidden:
                continue
            files[f"{package.replace('.', '/')}/{rel.as_posix()}"] = f"{folder}/{rel.as_posix()}"
    return files


def dist(src: str, dist_dir: str) -> None:
    wheels = list(Path(dist_dir).glob("*.whl"))
    sdists = list(Path(dist_dir).glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        fail(f"expected one wheel and one sdist in {dist_dir}, found {wheels + sdists}")
    expected = _expected(Path(src))
    wheel = set(zipfile.ZipFile(wheels[0]).namelist())
    with tarfile.open(sdists[0]) as tar:
        sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = [w for w in expected if w not in wheel]
    missing += [f"sdist: {s}" for s in [*expected.values(), "pyproject.toml", "README.md"]
                if s not in sdist]  # fmt: skip
    info = next((n for n in wheel if n.endswith(".dist-info/entry_points.txt")), None)
    entry = zipfile.ZipFile(wheels[0]).read(info).decode() if info else ""
    if "loraplex = loraplex.platform.cli:main" not in entry:
        missing.append("the `loraplex` console script in entry_points.txt")
    if missing:
        fail(f"missing from {wheels[0].name} / {sdists[0].name}:\n  " + "\n  ".join(missing))
    by_folder: dict[str, int] = {}
    for s in expected.values():
        by_folder[s.split("/")[0]] = by_folder.get(s.split("/")[0], 0) + 1
    data = [w for w in expected if not w.endswith(".py")]
    print(
        f"{wheels[0].name} ({len(wheel)} files) and {sdists[0].name} hold all {len(expected)} "
        f"files of {', '.join(f'{k}/ {v}' for k, v in by_folder.items())}; "
        f"data files: {', '.join(sorted(d.removeprefix('loraplex/') for d in data))}"
    )


def _echo(text: str) -> str:
    return f"echo {shlex.quote(text)}"


def docker(dockerfile: str, context: str, root: str) -> None:
    """COPY and WORKDIR as docker would do them, RUN steps that call pip run as written but
    with /src and /tmp under `root`; other steps (ENV, useradd, ...) are listed, not run."""
    text = re.sub(r"\\\n", "", Path(dockerfile).read_text())
    to_root = re.compile(r"(?<![\w.])/(src|tmp)(?=[/\s'\"]|$)")
    out = ["set -euo pipefail", f"mkdir -p {root}/tmp", _echo(f"(/src and /tmp are under {root})")]
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        op, _, arg = line.strip().partition(" ")
        arg = " ".join(arg.split())
        if op == "WORKDIR":
            out += [_echo(f"+ WORKDIR {arg}"), f"mkdir -p {root}{arg}", f"cd {root}{arg}"]
        elif op == "COPY":
            *sources, dest = arg.split()
            out.append(_echo(f"+ COPY {arg}"))
            for s in sources:
                if (Path(context) / s).is_dir():
                    out += [f"mkdir -p {dest}", f"cp -r {context}/{s}/. {dest}/"]
                else:
                    out.append(f"cp {context}/{s} {dest}")
        elif op == "RUN" and re.search(r"\bpip\b", arg):
            run = to_root.sub(lambda m: f"{root}/{m.group(1)}", arg)
            out += [_echo(f"+ RUN {arg}"), run]
        else:
            out.append(_echo(f"  (not run) {op} {arg[:70]}"))
    if not any(line.startswith("cp ") for line in out) or "pip install" not in "\n".join(out):
        fail(f"{dockerfile} no longer COPYs the source and pip-installs it; update the smoke")
    print("\n".join(out))


def db_head(db: str, migrations: str) -> None:
    revisions, parents = set(), set()
    for path in Path(migrations, "versions").glob("*.py"):
        source = path.read_text()
        rev = re.search(r"^revision\b[^=]*=\s*['\"](\w+)['\"]", source, re.M)
        down = re.search(r"^down_revision\b[^=]*=\s*['\"](\w+)['\"]", source, re.M)
        if rev:
            revisions.add(rev.group(1))
        if down:
            parents.add(down.group(1))
    heads = revisions - parents
    if len(heads) != 1:
        fail(f"expected one head revision in {migrations}/versions, found {sorted(heads)}")
    with sqlite3.connect(db) as conn:
        got = [r[0] for r in conn.execute("select version_num from alembic_version")]
    if got != list(heads):
        fail(f"{db} is at {got}, the newest migration is {sorted(heads)}")
    print(f"{db} is at the newest migration, {got[0]}")


COMMANDS = {
    "readme-run": readme_run,
    "snippets": snippets,
    "completion": completion,
    "chat": chat,
    "dist": dist,
    "docker": docker,
    "db-head": db_head,
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    COMMANDS[sys.argv[1]](*sys.argv[2:])
