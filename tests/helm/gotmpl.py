"""A small renderer for the subset of Go templates (and Helm functions) our chart uses.

`helm` cannot be installed on the machines that run our tests, so the chart checks render the
templates with this instead. It knows: `{{- -}}` whitespace trimming, comments,
`if / else`, `with / else`, `range`, `define` + `include`, pipelines, parentheses, `.`, `$`,
field paths, and the functions listed in `FUNCS`. Anything else raises `TemplateError`, so a
template that strays outside the subset fails loudly instead of rendering wrongly.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from typing import Any

import yaml


class TemplateError(Exception):
    pass


_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\(|\)|\||[^\s()|]+')


@dataclass
class Block:
    kind: str  # "if" | "with" | "range" | "define" | "root"
    expr: str = ""
    body: list = field(default_factory=list)
    orelse: list = field(default_factory=list)  # the `else` branch


def parse(text: str) -> Block:
    """The template as a tree of text strings, ("expr", str) outputs and Blocks."""
    parts: list = []
    pos = 0
    for m in _ACTION.finditer(text):
        chunk = text[pos : m.start()]
        if m.group(1):
            chunk = chunk.rstrip()
        if parts and parts[-1] == "TRIM_NEXT":
            parts.pop()
            chunk = chunk.lstrip()
        parts.append(chunk)
        parts.append(("action", m.group(2)))
        if m.group(3):
            parts.append("TRIM_NEXT")
        pos = m.end()
    tail = text[pos:]
    if parts and parts[-1] == "TRIM_NEXT":
        parts.pop()
        tail = tail.lstrip()
    parts.append(tail)

    root = Block("root")
    stack: list[tuple[Block, list]] = [(root, root.body)]
    for part in parts:
        if isinstance(part, str):
            stack[-1][1].append(part)
            continue
        action = part[1]
        word = action.split(None, 1)[0] if action else ""
        rest = action[len(word) :].strip()
        if action.startswith("/*"):
            continue
        if word in ("if", "with", "range", "define"):
            block = Block(word, rest.strip('"') if word == "define" else rest)
            stack[-1][1].append(block)
            stack.append((block, block.body))
        elif word == "else":
            block, _ = stack[-1]
            if rest:
                raise TemplateError(f"unsupported: else {rest} (write nested if blocks)")
            stack[-1] = (block, block.orelse)
        elif word == "end":
            stack.pop()
        else:
            stack[-1][1].append(("expr", action))
    if len(stack) != 1:
        raise TemplateError(f"unclosed {stack[-1][0].kind} block")
    return root


def truthy(v: Any) -> bool:
    return v not in (None, False, 0, "") and not (isinstance(v, dict | list) and not v)


def to_text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _required(msg: str, v: Any) -> Any:
    if not truthy(v):
        raise TemplateError(f"required: {msg}")
    return v


FUNCS = {
    "default": lambda d, v=None: v if truthy(v) else d,
    "trunc": lambda n, s: s[:n],
    "trimSuffix": lambda suf, s: s.removesuffix(suf),
    "printf": lambda fmt, *a: re.sub(r"%[sdv]", "{}", fmt).format(*map(to_text, a)),
    "quote": lambda v: json.dumps(to_text(v)),
    "toYaml": lambda v: yaml.safe_dump(v, default_flow_style=False, sort_keys=False).rstrip("\n"),
    "nindent": lambda n, s: "\n" + "\n".join(" " * n + ln if ln else ln for ln in s.split("\n")),
    "indent": lambda n, s: "\n".join(" " * n + ln if ln else ln for ln in s.split("\n")),
    "required": _required,
    "b64enc": lambda s: base64.b64encode(to_text(s).encode()).decode(),
    "not": lambda v: not truthy(v),
    "and": lambda *a: next((x for x in a if not truthy(x)), a[-1]),
    "or": lambda *a: next((x for x in a if truthy(x)), a[-1]),
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
}


class Renderer:
    def __init__(self, templates: dict[str, str]):
        self.defines: dict[str, Block] = {}
        self.trees = {name: parse(text) for name, text in templates.items()}
        for tree in self.trees.values():
            self._collect(tree)

    def _collect(self, block: Block) -> None:
        for node in block.body:
            if isinstance(node, Block) and node.kind == "define":
                self.defines[node.expr] = node

    def render(self, name: str, root: dict) -> str:
        return self._run(self.trees[name].body, root, root)

    def _run(self, nodes: list, dot: Any, root: dict) -> str:
        out = []
        for node in nodes:
            if isinstance(node, str):
                out.append(node)
            elif isinstance(node, tuple):
                out.append(to_text(self._eval(node[1], dot, root)))
            elif node.kind == "define":
                continue
            elif node.kind == "if":
                cond = truthy(self._eval(node.expr, dot, root))
                out.append(self._run(node.body if cond else node.orelse, dot, root))
            elif node.kind == "with":
                v = self._eval(node.expr, dot, root)
                out.append(
                    self._run(node.body, v, root)
                    if truthy(v)
                    else self._run(node.orelse, dot, root)
                )
            elif node.kind == "range":
                items = self._eval(node.expr, dot, root) or []
                out.extend(self._run(node.body, item, root) for item in items)
        return "".join(out)

    def _eval(self, expr: str, dot: Any, root: dict) -> Any:
        return self._pipeline(_TOKEN.findall(expr), dot, root)

    def _pipeline(self, tokens: list[str], dot: Any, root: dict) -> Any:
        commands, depth, current = [], 0, []
        for t in tokens:
            depth += (t == "(") - (t == ")")
            if t == "|" and depth == 0:
                commands.append(current)
                current = []
            else:
                current.append(t)
        commands.append(current)
        value, piped = None, False
        for cmd in commands:
            args = self._args(cmd[1:] if cmd[0] in FUNCS or cmd[0] == "include" else cmd, dot, root)
            if piped:
                args.append(value)
            if cmd[0] == "include":
                name, ctx = args
                value = self._run(self.defines[name].body, ctx, root)
            elif cmd[0] in FUNCS:
                value = FUNCS[cmd[0]](*args)
            elif len(args) == 1:
                value = args[0]
            else:
                raise TemplateError(f"unknown function {cmd[0]!r}")
            piped = True
        return value

    def _args(self, tokens: list[str], dot: Any, root: dict) -> list:
        args, i = [], 0
        while i < len(tokens):
            t = tokens[i]
            if t == "(":
                depth, j = 1, i + 1
                while depth:
                    depth += (tokens[j] == "(") - (tokens[j] == ")")
                    j += 1
                args.append(self._pipeline(tokens[i + 1 : j - 1], dot, root))
                i = j
                continue
            args.append(self._atom(t, dot, root))
            i += 1
        return args

    def _atom(self, t: str, dot: Any, root: dict) -> Any:
        if t.startswith('"'):
            return json.loads(t)
        if re.fullmatch(r"-?\d+", t):
            return int(t)
        if t in ("true", "false", "nil"):
            return {"true": True, "false": False, "nil": None}[t]
        if t == ".":
            return dot
        if t.startswith(("$", ".")):
            value = root if t.startswith("$") else dot
            for key in t.lstrip("$").split(".")[1:] if t.startswith("$") else t.split(".")[1:]:
                value = value.get(key) if isinstance(value, dict) else None
            return value
        raise TemplateError(f"unsupported token {t!r}")
