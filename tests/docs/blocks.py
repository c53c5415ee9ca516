"""The code blocks of README.md and docs/*.md, with the `docs-test` markers the pages give them
(docs/README.md writes the convention down).

A fenced block tagged `sh`, `bash`, `shell`, `console` or `python` is runnable: it runs, or its
marker says why it cannot. Other tags (`json`, `yaml`, `text`, none) are data, diagrams and
measured output; a `json` block can be a file the page's other blocks read (`file=PATH`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"sh", "bash", "shell", "console", "python"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
# First words that make an untagged block a command a reader would paste: it must say so.
COMMAND_START = re.compile(
    r"^(\$ |curl |loraplex |python3? |pip |helm |kubectl |export |LORAPLEX_\w+=)"
)


def pages() -> list[Path]:
    """README.md, then docs/*.md by name: pages added later are picked up as they come."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Marker:
    skip: str | None = None  # the reason, when the block does not run here
    tenant: str | None = None  # the name of the fresh tenant the block runs as
    setup: list[str] = field(default_factory=list)  # named states: SETUPS, test_docs_run.py
    file: str | None = None  # a data block written into the page's folder under this name

    @classmethod
    def parse(cls, text: str, where: str) -> Marker:
        marker = cls()
        skip = re.fullmatch(r"skip\s*\((.+)\)", text, re.S)
        if skip:
            marker.skip = " ".join(skip.group(1).split())
            return marker
        if text.startswith("skip"):
            raise ValueError(f"{where}: write the reason: <!-- docs-test: skip (why) -->")
        for word in text.split():
            key, _, value = word.partition("=")
            if key == "tenant" and value:
                marker.tenant = value
            elif key == "setup" and value:
                marker.setup = value.split(",")
            elif key == "file" and value:
                marker.file = value
            else:
                raise ValueError(
                    f"{where}: unknown docs-test marker {word!r} (skip (why), tenant=NAME, "
                    "setup=NAME[,NAME], file=PATH)"
                )
        return marker


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: Marker

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE


def blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, with the marker on the nearest non-blank line above it."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        # A block inside a list item is indented with it: take the item's indent off.
        body = "\n".join(_dedent(line, indent) for line in lines[i + 1 : end])
        above = i - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        found = MARKER.search(lines[above]) if above >= 0 else None
        where = f"{page.relative_to(ROOT)}:{i + 1}"
        marker = Marker.parse(found.group(1), where) if found else Marker()
        out.append(Block(page, i + 1, lang, body + "\n", marker))
        i = end + 1
    return out


def _dedent(line: str, indent: int) -> str:
    return line[indent:] if line[:indent].strip() == "" else line.lstrip()


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


# --- what prose names -----------------------------------------------------------------------

INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
# `loraplex` where a shell reads it as the command: a line's start, after a prompt, a venv's
# bin/, or another command.
COMMAND = re.compile(r"(?:^|\$ |bin/|&& |; |\s{2,})loraplex ([^|;&#`)\n]+)", re.M)
SETTING = re.compile(r"\bLORAPLEX_[A-Z0-9_]*[A-Z0-9]")


def prose(page: Path) -> str:
    """The page without its fenced blocks."""
    text = page.read_text()
    return re.sub(r"^(\s*)(`{3,}|~{3,}).*?^\s*\2\s*$", "", text, flags=re.M | re.S)


def cli_commands(page: Path) -> list[list[str]]:
    """Each `loraplex …` command the page names, in inline code or a code block (fenced or
    indented), as the words after `loraplex` up to what is not the command's own (a pipe,
    `;`, `&&`, a comment, a closing parenthesis)."""
    snippets = [m.group(1) for m in INLINE_CODE.finditer(prose(page))]
    snippets += [b.text for b in blocks(page) if b.lang in RUNNABLE | {""}]
    snippets += [line for line in prose(page).splitlines() if line.startswith("    ")]
    found = []
    for snippet in snippets:
        for m in COMMAND.finditer(snippet):
            words = _words(m.group(1))
            if words:
                found.append(words)
    return found


def _words(text: str) -> list[str]:
    text = text.replace("…", " ").replace("...", " ")
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    return [w.strip("[]") for w in words if w.strip("[]")]
