"""A model of the adapter registry for the race tests: what uploads and deletes do when run one
at a time, and whether answers seen under concurrency match some one-at-a-time order
(linearizability, checked by trying every order of a small batch).

An operation is `("upload", tenant, name, content)` or `("delete", tenant, name)`; the model
maps `(tenant, name)` to the content last uploaded under that name. Outcomes: "created",
"conflict" (the name is taken), "deleted", "missing" (no such adapter), "refused" (the tenant
is suspended).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

Model = dict[tuple, object]


def apply(model: Model, op: tuple, active: bool = True) -> tuple[str, Model]:
    """(outcome, model after) of `op` run alone; `model` is not changed."""
    kind, tenant, name, *rest = op
    if not active:
        return "refused", model
    after = dict(model)
    if kind == "upload":
        if (tenant, name) in after:
            return "conflict", model
        after[(tenant, name)] = rest[0]
        return "created", after
    return ("deleted" if after.pop((tenant, name), None) is not None else "missing"), after


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
