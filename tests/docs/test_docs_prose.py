"""What the pages name in prose exists: `loraplex` commands and their flags, the files and
pages they link to, the `LORAPLEX_*` settings; and the markers and tags the runner needs."""

from __future__ import annotations

import argparse
import re

from loraplex.platform.cli import build_parser
from loraplex.platform.settings import Settings
from tests.docs.blocks import (
    COMMAND_START,
    LINK,
    ROOT,
    SETTING,
    all_blocks,
    cli_commands,
    pages,
    prose,
)

# Read by the settings machinery itself, not a field: the config file's path.
NOT_FIELDS = {"LORAPLEX_CONFIG"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _unknown(words: list[str]) -> str | None:
    """What of `loraplex <words>` the parser does not have, or None."""
    parser, path = build_parser(), ["loraplex"]
    while words and words[0] in _subparsers(parser):
        parser = _subparsers(parser)[words[0]]
        path.append(words.pop(0))
    if _subparsers(parser) and words:  # a group named alone (`loraplex adapters`) is fine
        return f"{' '.join(path)} has no command {words[0] if words else '(none named)'!r}"
    for word in words:
        flag = word.split("=")[0]
        if re.fullmatch(r"--?[a-z][\w-]*", flag) and flag not in parser._option_string_actions:
            return f"{' '.join(path)} has no flag {flag}"
    return None


def test_cli_commands_named_exist_with_the_flags_named():
    problems, checked = [], 0
    for page in pages():
        for words in cli_commands(page):
            checked += 1
            if (problem := _unknown(list(words))) is not None:
                named = f"`loraplex {' '.join(words)}`"
                problems.append(f"{page.relative_to(ROOT)}: {named}: {problem}")
    assert checked > 30
    assert not problems, "\n".join(problems)


def test_the_command_check_names_what_the_parser_lacks():
    assert _unknown(["usage", "summary", "--group-by", "version", "--tenant", "acme"]) is None
    assert _unknown(["adapters"]) is None  # a group, named alone
    assert _unknown(["usage", "summarise"]) == "loraplex usage has no command 'summarise'"
    assert _unknown(["usage", "summary", "--by=v"]) == "loraplex usage summary has no flag --by"


def test_relative_links_resolve():
    broken, checked = [], 0
    for page in pages():
        for m in LINK.finditer(prose(page)):
            target = m.group(1)
            if re.match(r"^[a-z]+:|^#", target):
                continue  # another site, or a heading of this page
            checked += 1
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert checked > 30
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def _switches_read_by_code() -> set[str]:
    """`LORAPLEX_*` names the code reads itself (a test's or a tool's switch, the kernels'
    dispatch): quoted in a source file outside these tests."""
    names: set[str] = set()
    for folder in (
        "engine",
        "kernels",
        "platform",
        "bench",
        "benchmarks",
        "scripts",
        "testkit",
        "tests",
    ):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and "docs" not in path.relative_to(ROOT).parts[1:2]:
                text = path.read_text(errors="replace")
                names |= set(re.findall(rf"[\"']({SETTING.pattern})[\"'=]", text))
    return names


def test_every_loraplex_variable_named_is_a_setting():
    """Each `LORAPLEX_*` a page names is a setting (platform/settings.py, the engine options of
    engine/options.py), or a switch the code reads: never a name nothing reads."""
    known = {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields} | NOT_FIELDS
    named = {(page, name) for page in pages() for name in SETTING.findall(page.read_text())}
    assert len(named) > 10
    unread = {(page, name) for page, name in named if name not in known}
    switches = _switches_read_by_code() if unread else set()
    unknown = sorted(f"{p.relative_to(ROOT)}: {n}" for p, n in unread if n not in switches)
    assert not unknown, "neither a setting nor read by the code:\n" + "\n".join(unknown)


def test_blocks_that_read_as_commands_say_their_language():
    untagged = [b.id for b in all_blocks() if not b.lang and COMMAND_START.match(b.text.lstrip())]
    assert not untagged, "tag these blocks (sh, python, ...) so they run or say why not: " + (
        ", ".join(untagged)
    )


def test_markers_are_on_blocks_they_fit():
    misplaced = [b.id for b in all_blocks() if b.marker.file and b.runnable]
    misplaced += [
        b.id
        for b in all_blocks()
        if not b.runnable and (b.marker.skip or b.marker.setup or b.marker.tenant)
    ]
    assert not misplaced, "file= goes on data blocks, the others on runnable ones: " + (
        ", ".join(misplaced)
    )


def test_every_page_is_in_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {m.group(1) for m in LINK.finditer(index.read_text())}
    missing = [p.name for p in pages()[1:] if p != index and p.name not in linked]
    assert not missing, "docs/README.md's index lacks: " + ", ".join(missing)


def test_lab_commands_named_exist():
    """`python -m benchmarks.NAME` in the pages names a module of the lab (never a made-up
    `bench NAME`: `loraplex bench serve` is the only installed bench command)."""
    named = {
        (page.name, name)
        for page in pages()
        for name in re.findall(r"python -m benchmarks\.(\w+)", page.read_text())
    }
    lab = ROOT / "benchmarks"
    missing = [
        f"{page}: benchmarks.{name}"
        for page, name in sorted(named)
        if not (lab / f"{name}.py").is_file() and not (lab / name / "__main__.py").is_file()
    ]
    assert not missing, "no such lab module: " + ", ".join(missing)
    made_up = [p.name for p in pages() if re.search(r"`bench (?!serve)\w+", p.read_text())]
    assert not made_up, "name the lab's commands `python -m benchmarks.NAME`: " + ", ".join(made_up)
