"""A model of the adapter registry for the race tests: what uploads, deletes and version
changes do when run one at a time, and whether answers seen under concurrency match some
one-at-a-time order (linearizability, checked by trying every order of a small batch).

Operations: `("upload", tenant, name, content)` (the name's next version; its first also
takes the default alias), `("publish", tenant, name, content)` (an in-place update: the next
version and the default alias at once), `("delete", tenant, name)` (every version),
`("promote", tenant, name, version)` (the default alias to that version) and
`("drop", tenant, name, version)` (one version, refused while the default alias uses it).
The model maps `(tenant, name)` to an `Entry`. Outcomes: "created", "deleted", "promoted",
"dropped", "missing" (no such adapter or version), "in_use", "refused" (the tenant is
suspended).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple


class Entry(NamedTuple):
    next: int  # the number the next version gets (never one given before)
    default: int  # the version the default alias points at
    versions: tuple[tuple[int, object], ...]  # (version, content), live ones


Model = dict[tuple, Entry]


def apply(model: Model, op: tuple, active: bool = True) -> tuple[str, Model]:
    """(outcome, model after) of `op` run alone; `model` is not changed."""
    kind, tenant, name, *rest = op
    if not active:
        return "refused", model
    after, key = dict(model), (tenant, name)
    entry = after.get(key)
    if kind in ("upload", "publish"):
        if entry is None:
            after[key] = Entry(2, 1, ((1, rest[0]),))
        else:
            v = entry.next
            default = v if kind == "publish" else entry.default
            after[key] = Entry(v + 1, default, (*entry.versions, (v, rest[0])))
        return "created", after
    if kind == "delete":
        return ("deleted" if after.pop(key, None) is not None else "missing"), after
    version = rest[0]
    if entry is None or version not in dict(entry.versions):
        return "missing", model
    if kind == "promote":
        after[key] = entry._replace(default=version)
        return "promoted", after
    if entry.default == version:
        return "in_use", model
    after[key] = entry._replace(versions=tuple(p for p in entry.versions if p[0] != version))
    return "dropped", after


def linearize(
    model: Model,
    ops: Sequence[tuple],
    outcomes: Sequence[str],
    registry: dict,
    view: Callable[[Model], dict] = dict,
    active: Callable[[object], bool] = lambda tenant: True,
) -> Model | None:
    """The model after the first order of `ops` whose outcomes are `outcomes` and whose end
    state, seen through `view`, is `registry`; None when no order explains what was seen."""
    for order in itertools.permutations(range(len(ops))):
        m, got = model, [None] * len(ops)
        for i in order:
            got[i], m = apply(m, ops[i], active(ops[i][1]))
        if got == list(outcomes) and view(m) == registry:
            return m
    return None
