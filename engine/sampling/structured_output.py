"""Structured output: grammar-constrained decoding with xgrammar, as a logits processor.

A request asks for a grammar with a spec in `SamplingParams.logits_processors`:

    {"kind": "grammar", "type": "json_schema", "value": {...schema...}}
    {"kind": "grammar", "type": "json_object"}            any JSON object
    {"kind": "grammar", "type": "regex", "value": "[a-z]+"}
    {"kind": "grammar", "type": "choice", "value": ["yes", "no"]}
    {"kind": "grammar", "type": "ebnf", "value": 'root ::= "a" | "b"'}

Each step the grammar's matcher says which tokens may come next as a bitmask (one bit per token
of the logits' width); every constrained row of the batch fills its row of one bitmask, which
is applied to the logits in one call. Grammars are compiled once per (type, value) for the
engine's tokenizer and kept in a bounded LRU in the processor context's shared cache.

When the grammar has matched a whole sentence it allows only the end-of-sequence tokens, so the
request ends with finish_reason "stop". A request that reaches max_tokens first ends with
"length" and its text is an unfinished sentence of the grammar (as OpenAI's API does).
Strings in a JSON schema without `maxLength` are unbounded: a model may keep writing one.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from loraplex.engine.sampling.logits_processors import LogitsProcessor, ProcessorContext, register

log = logging.getLogger(__name__)

KIND = "grammar"
TYPES = ("json_schema", "json_object", "regex", "choice", "ebnf")
MAX_CACHED_GRAMMARS = 256
_COMPILER_KEY = "xgrammar.compiler"
_COMPILED_KEY = "xgrammar.compiled"
# xgrammar's errors start with "[time] /path/file.cc:line: "; users need only the message.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


# xgrammar 0.2.9 writes a character of a string with minLength/maxLength as this class, which
# lets raw control characters (U+0000-U+001F but CR/LF) through: invalid JSON that strict
# parsers (Python's json.loads) refuse (xgrammar issue #800). We use the class of its plain
# strings instead; escapes stay unavailable in bounded strings, as before.
_BOUNDED_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\0-\x1f\"\\]"


def grammar_spec(type_: str, value: Any = None) -> dict:
    """The processor spec for one grammar, checked: ValueError naming what is wrong.

    The check parses the grammar without a tokenizer (fast), so a server can refuse a bad
    schema before the request reaches the engine.
    """
    if type_ not in TYPES:
        raise ValueError(f"unknown grammar type {type_!r} (known: {', '.join(TYPES)})")
    spec = {"kind": KIND, "type": type_, "value": _normalise(type_, value)}
    _grammar(spec)
    return spec


def _normalise(type_: str, value: Any) -> Any:
    if type_ == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(value, dict | bool):
            raise ValueError("a JSON schema must be a JSON object")
        return value
    if type_ == "json_object":
        return None
    if type_ == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return value
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {type_} grammar must be a non-empty string")
    return value


def _grammar(spec: dict):
    """The xgrammar Grammar of a spec (not yet compiled for a tokenizer)."""
    import xgrammar as xgr  # slow to import: only requests that use it pay

    type_, value = spec.get("type"), spec.get("value")
    try:
        if type_ in ("json_schema", "json_object"):
            schema = json.dumps(value) if type_ == "json_schema" else '{"type": "object"}'
            ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
            return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_CHAR, _JSON_CHAR))
        if type_ == "regex":
            return xgr.Grammar.from_regex(value)
        if type_ == "choice":
            # JSON string escapes are valid EBNF string escapes.
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
            return xgr.Grammar.from_ebnf(f"root ::= {alts}")
        if type_ == "ebnf":
            return xgr.Grammar.from_ebnf(value)
    except RuntimeError as e:
        raise ValueError(f"invalid {type_}: {_native_message(e)}") from None
    raise ValueError(f"unknown grammar type {type_!r} (known: {', '.join(TYPES)})")


def _native_message(e: Exception) -> str:
    text = str(e).strip()
    return _NATIVE_PREFIX.sub("", text).split("\n")[0].strip() or type(e).__name__


def _compiler(ctx: ProcessorContext):
    """One GrammarCompiler per engine (per tokenizer and logits width), built on first use."""
    compiler = ctx.cache.get(_COMPILER_KEY)
    if compiler is None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        if ctx.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        hf = PreTrainedTokenizerFast(tokenizer_object=ctx.tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=ctx.vocab_size, stop_token_ids=sorted(ctx.eos_token_ids) or None
        )
        compiler = ctx.cache[_COMPILER_KEY] = xgr.GrammarCompiler(
            info, max_threads=2, cache_enabled=False
        )
    return compiler


def _compiled(spec: dict, ctx: ProcessorContext):
    key = (spec.get("type"), json.dumps(spec.get("value"), sort_keys=True))
    lru: OrderedDict = ctx.cache.setdefault(_COMPILED_KEY, OrderedDict())
    compiled = lru.get(key)
    if compiled is not None:
        lru.move_to_end(key)
        return compiled
    compiler = _compiler(ctx)
    grammar = _grammar(spec)
    try:
        compiled = compiler.compile_grammar(grammar)
    except RuntimeError as e:
        raise ValueError(f"invalid {spec.get('type')}: {_native_message(e)}") from None
    lru[key] = compiled
    while len(lru) > MAX_CACHED_GRAMMARS:
        lru.popitem(last=False)
    return compiled


@register(KIND)
def _build(spec: dict, ctx: ProcessorContext) -> GrammarProcessor:
    import xgrammar as xgr

    return GrammarProcessor(xgr.GrammarMatcher(_compiled(spec, ctx)), ctx.vocab_size)


class GrammarProcessor(LogitsProcessor):
    """One request's grammar matcher; masks every token the grammar cannot take next."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.rejected = False  # a token the grammar refused was produced (see accept)

    @classmethod
    def apply_batch(cls, logits, rows, processors) -> None:
        import xgrammar as xgr

        n, vocab = logits.shape
        # [rows, ceil(vocab / 32)] int32, all allowed; a step's own (small: 4 bytes per 32
        # tokens a row), so nothing is kept between steps or engines
        bitmask = xgr.allocate_token_bitmask(n, vocab)
        live = []
        for row, proc in zip(rows, processors, strict=True):
            if not proc.matcher.is_terminated():
                proc.matcher.fill_next_token_bitmask(bitmask, row)
                live.append(row)
        if not live:
            return
        if logits.device.type != "cpu":
            mask = bitmask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=live)
            return
        dense = _mask_sparse_rows(logits, bitmask, live)
        if dense:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=dense)

    def accept(self, token_id: int) -> None:
        if self.matcher.is_terminated() or self.rejected:
            return
        if not self.matcher.accept_token(token_id):
            # Only when another mask removed every token the grammar allows (min_tokens
            # banning the end-of-sequence token of a finished grammar): end the request.
            log.warning("the grammar refused token %d; ending the request", token_id)
            self.rejected = True

    def is_finished(self) -> bool:
        return self.rejected or self.matcher.is_terminated()

    def fork(self) -> GrammarProcessor:
        twin = GrammarProcessor(self.matcher.fork(), self.vocab_size)
        twin.rejected = self.rejected
        return twin

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)


_BIT = np.arange(32, dtype=np.int32)


def _mask_sparse_rows(
    logits: torch.Tensor,  # [rows, vocab] float32 on the CPU, changed in place
    bitmask: torch.Tensor,  # [rows, ceil(vocab / 32)] int32, bit j of word w: token 32w + j
    rows: list[int],
) -> list[int]:
    """Mask the rows whose grammar allows few tokens; return the others (the dense rows).

    xgrammar's CPU kernel skips words whose 32 tokens are all allowed but writes -inf token by
    token elsewhere, which is slow at a large vocabulary where a grammar between JSON values
    allows a handful of tokens. Such rows are cheaper refilled: keep the allowed logits, set
    the row to -inf, put them back. In numpy, not torch: these small ops in torch's thread
    pool wait on its barrier, which a busy machine stretches. (Figures and the command that
    measures them: docs/benchmarks.md, "Measurements behind choices in the code".)
    """
    x = logits.numpy()  # a view: writes reach the tensor
    rows_a = np.asarray(rows)
    words = bitmask.numpy()[rows_a]  # [k, words]
    sparse = np.count_nonzero(words == 0, axis=1) * 2 > words.shape[1]  # [k] mostly nothing
    if not sparse.any():
        return rows
    which = np.flatnonzero(sparse)
    sub = words[which]  # [s, words]
    r, w = np.nonzero(sub)  # [m] the words that allow something
    hit, bit = np.nonzero((sub[r, w][:, None] >> _BIT) & 1)  # [a]
    ids = w[hit] * 32 + bit  # [a] allowed token ids
    keep = ids < x.shape[1]
    at = rows_a[which][r[hit]][keep]
    ids = ids[keep]
    values = x[at, ids]
    x[rows_a[which]] = -np.inf
    x[at, ids] = values
    return [row for row, s in zip(rows, sparse.tolist(), strict=True) if not s]
