"""Tokenizer: `tokenizer.json` via the `tokenizers` library, chat templates, streaming detokenizer.

No transformers import here: the engine must start fast and must not depend on transformers'
tokenizer classes. The files read are the ones a Hugging Face model folder carries:

    tokenizer.json           the tokenizer itself (required)
    tokenizer_config.json    bos/eos strings, chat_template (optional)
    chat_template.jinja      chat template as transformers 5 saves it (optional)
    config.json              eos_token_id / bos_token_id (optional)
    generation_config.json   eos_token_id, often a list (optional)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What the byte-level / byte-fallback decoders emit for an incomplete UTF-8 sequence.
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context for the first generated tokens, so that decoders which strip
# a leading space from the first token of a decode call do not strip it from generated text.
_PROMPT_CONTEXT_TOKENS = 6


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    # Older tokenizer_config.json files store special tokens as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_chat_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    # jinja's builtin tojson HTML-escapes '<', '>' and '&', which would corrupt tool schemas.
    return json.dumps(value, ensure_ascii=False, indent=indent)


class Tokenizer:
    """A model folder's tokenizer: ids <-> text, special tokens and chat template."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        if self.bos_token_id is None and bos_token is not None:
            self.bos_token_id = tokenizer.token_to_id(bos_token)
        if bos_token is None and self.bos_token_id is not None:
            bos_token = tokenizer.id_to_token(self.bos_token_id)
        eos_ids = set(eos_token_ids)
        if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
            eos_ids.add(eos_id)
        if eos_token is None and eos_ids:
            eos_token = tokenizer.id_to_token(min(eos_ids))
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids: set[int] = eos_ids
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {root}: the model folder needs a fast-tokenizer file "
                "(save one with transformers' tokenizer.save_pretrained or "
                "tokenizers.Tokenizer.save)"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"cannot parse {tok_file}: {exc}") from exc

        tok_cfg = _read_json(root / "tokenizer_config.json")
        model_cfg = _read_json(root / "config.json")
        gen_cfg = _read_json(root / "generation_config.json")

        eos_ids = _as_id_list(gen_cfg.get("eos_token_id")) + _as_id_list(
            model_cfg.get("eos_token_id")
        )
        bos_token = _token_content(tok_cfg.get("bos_token"))
        bos_id = None if bos_token is not None else model_cfg.get("bos_token_id")

        template = _pick_chat_template(tok_cfg.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        return cls(
            tok,
            bos_token=bos_token,
            eos_token=_token_content(tok_cfg.get("eos_token")),
            bos_token_id=bos_id if isinstance(bos_id, int) else None,
            eos_token_ids=eos_ids,
            chat_template=template,
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object itself (grammar engines build their vocabulary from it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's chat template; `extra` (e.g. `tools`) is passed on.

        Raises ValueError when the model has no template or the template rejects the input.
        """
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (none in tokenizer_config.json or "
                "chat_template.jinja); use the completions API or supply a template"
            )
        try:
            if self._compiled_template is None:
                self._compiled_template = _chat_env().from_string(self.chat_template)
            return self._compiled_template.render(
                messages=messages,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    def detokenizer(
        self,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        kept: list[str] | None = None,
    ) -> IncrementalDetokenizer:
        keep = frozenset(self.special_token_ids & {self._tok.token_to_id(t) for t in kept or ()})
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens, keep)


def _chat_env() -> ImmutableSandboxedEnvironment:
    # Sandboxed because templates come from downloaded model folders.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one `push` per generated token.

    Each push decodes only a short window `ids[prefix:]` and emits what it adds over
    `ids[prefix:read]`, so cost per token does not grow with the generation:

        ids:   ... | prefix ........ read | new tokens
                     ^ already emitted ^   ^ pending (emitted when they decode cleanly)

    A window whose text ends in U+FFFD is an incomplete UTF-8 sequence (a multi-byte character
    split across tokens) and is held back until a later token completes it. The window then
    starts at a character boundary, so concatenating every delta plus `flush()` gives exactly
    `decode(ids)` of the generated ids (with `prompt_ids`: the text the generated ids add after
    the prompt). That holds for any ids with byte-level (GPT-2 style) decoders. Byte-fallback
    decoders (SentencePiece: Llama 2, Gemma) turn a whole run of <0xNN> tokens into U+FFFD when
    a later byte makes the run invalid UTF-8, retroactively; there it holds whenever the
    generated bytes are valid UTF-8.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self._tokenizer = tokenizer
        # Skipped specials never enter the window: decode drops them before its decoder runs, and
        # a window opening on one would let a leading-space Strip decoder eat real text. Kept
        # ones (`keep`) do enter it, so the window is decoded with its specials as written.
        dropped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._dropped = dropped - keep if keep else dropped  # (no copy per request without)
        self._skip = skip_special_tokens and not keep
        context = [i for i in prompt_ids or () if i not in self._dropped]
        context = context[-_PROMPT_CONTEXT_TOKENS:]
        self._context_len = len(context)
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded until they complete or flush)."""
        return "".join(self._chunks)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly printable text (often "", never a partial char)."""
        if token_id in self._dropped:
            return ""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (ends with U+FFFD: the generation stopped mid-character)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        window = self._ids[self._prefix :]
        new_text = self._tokenizer.decode(window, skip_special_tokens=self._skip)
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""
        prefix_text = self._tokenizer.decode(
            self._ids[self._prefix : self._read], skip_special_tokens=self._skip
        )
        if new_text.startswith(prefix_text):
            delta = new_text[len(prefix_text) :]
        else:
            delta = self._full_decode_delta()
        self._prefix, self._read = self._read, len(self._ids)
        self._chunks.append(delta)
        return delta

    def _full_decode_delta(self) -> str:
        # Some decoders rewrite text across token boundaries; fall back to the exact (O(n)) way.
        ctx_text = self._tokenizer.decode(self._ids[: self._context_len], self._skip)
        full = self._tokenizer.decode(self._ids, self._skip)
        emitted = len(ctx_text) + sum(len(c) for c in self._chunks)
        return full[emitted:]
