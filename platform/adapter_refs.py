"""How a request's `model` reaches one immutable adapter version.

    "sql"          the name's default alias
    "sql@canary"   another alias of the name
    "sql@v3"       version 3 itself (pinned)

An alias points at one version or splits traffic by integer weights ({"3": 90, "4": 10}).
With the request's `user` field the draw is a hash of tenant, name, alias and user, so one
end user keeps seeing one version on every replica for as long as the split stays; without
it each request draws at random.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from loraplex.platform.db.crud import DEFAULT_ALIAS

_VERSION = re.compile(r"v([1-9][0-9]{0,8})")
ALIAS_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
_ALIAS = re.compile(ALIAS_PATTERN.removeprefix("^").removesuffix("$"))
ALIAS_RULE = "1-64 letters, digits, '_' or '-', starting with a letter (and not v<number>)"


@dataclass(frozen=True)
class AdapterRef:
    name: str
    version: int | None = None  # pinned; else the alias decides
    alias: str = DEFAULT_ALIAS


def is_alias_name(value: str) -> bool:
    return _ALIAS.fullmatch(value) is not None and _VERSION.fullmatch(value) is None


def parse_ref(model: str) -> AdapterRef | None:
    """The adapter reference in `model`, or None when it cannot name one."""
    name, at, suffix = model.partition("@")
    if not at:
        return AdapterRef(name)
    if (pinned := _VERSION.fullmatch(suffix)) is not None:
        return AdapterRef(name, version=int(pinned.group(1)))
    return AdapterRef(name, alias=suffix) if is_alias_name(suffix) else None


def parse_version(value: str | int) -> int:
    """A version as users write it ("v3", "3" or 3); ValueError otherwise."""
    text = str(value)
    found = _VERSION.fullmatch(text) or _VERSION.fullmatch(f"v{text}")
    if found is None:
        raise ValueError(f"{text[:40]!r} is not a version (write v1, v2, ...)")
    return int(found.group(1))


def choose_version(weights: dict[str, int], *, sticky_key: str | None) -> int:
    """One version of a split, by weight; the same one for the same `sticky_key`."""
    pairs = sorted((int(v), int(w)) for v, w in weights.items() if int(w) > 0)
    if len(pairs) == 1:
        return pairs[0][0]
    total = sum(w for _, w in pairs)
    if sticky_key is None:
        point = random.randrange(total)
    else:
        digest = hashlib.sha256(sticky_key.encode()).digest()
        point = int.from_bytes(digest[:8], "big") % total
    for version, weight in pairs:
        if point < weight:
            return version
        point -= weight
    return pairs[-1][0]
