"""Logprobs in the shapes clients read: OpenAI's legacy completions `logprobs` object (with
`echo`: the prompt's tokens first, the first one without a logprob) and vLLM's
`prompt_logprobs` list, and the chat answer's `logprobs.content`.

`text_offset` gives each token's first character in the choice's text, the echoed prompt
included. Offsets come from the same incremental detokenization that writes the text, so
`text[offset[i]:offset[i + 1]]` is token i's text; a token that ends inside a multi-byte
character, or a special token left out of the text (a BOS), takes no characters.
"""

from __future__ import annotations

from loraplex.engine import PromptLogprobs, RequestOutput, Tokenizer
from loraplex.platform.openai.responses import ChatLogprobs, TokenLogprob, TopLogprob


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _empty() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


class LegacyLogprobs:
    """One completion choice's `logprobs` object, built piece by piece as the choice streams
    (each piece covers the tokens its chunk carries; the pieces join into the whole object).

    `top`: the alternatives asked for (`logprobs`); the chosen (or prompt) token's own logprob
    is always in its `top_logprobs` entry too, so an entry has up to top + 1 keys, as OpenAI's.
    """

    def __init__(self, tok: Tokenizer, prompt_ids: list[int], top: int) -> None:
        self.tok, self.prompt_ids, self.top = tok, prompt_ids, top
        self.offset = 0  # characters of the choice's text before what the engine generated
        self._generated = tok.detokenizer(prompt_ids)  # as the engine writes the choice's text

    def echoed(self, scored: PromptLogprobs | None, echo: str) -> dict:
        """The prompt's piece; `echo` is the text the choice starts with."""
        out = _empty()
        self.offset = len(echo)
        if scored is None:  # the request ended before its prompt was scored
            return out
        detok = self.tok.detokenizer()
        for i, t in enumerate(self.prompt_ids):
            out["tokens"].append(token_text(self.tok, t))
            out["text_offset"].append(len(detok.text))
            detok.push(t)
            lp = scored.token_logprobs[i]
            out["token_logprobs"].append(lp)
            if lp is None:
                out["top_logprobs"].append(None)
                continue
            entry = {token_text(self.tok, t): lp}
            for alt, v in scored.top[i][: self.top]:
                entry.setdefault(token_text(self.tok, alt), v)
            out["top_logprobs"].append(entry)
        return out

    def generated(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict:
        """The next generated tokens' piece; entries: per token {token id: logprob}, the
        chosen token first (CompletionOutput.logprobs)."""
        out = _empty()
        for t, e in zip(token_ids, entries, strict=True):
            out["tokens"].append(token_text(self.tok, t))
            out["text_offset"].append(self.offset + len(self._generated.text))
            self._generated.push(t)
            out["token_logprobs"].append(e.get(t))
            out["top_logprobs"].append({token_text(self.tok, k): v for k, v in e.items()})
        return out


def joined(*pieces: dict) -> dict:
    out = _empty()
    for p in pieces:
        for key, values in p.items():
            out[key] += values
    return out


def vllm_prompt_logprobs(
    tok: Tokenizer, prompt_ids: list[int], scored: PromptLogprobs | None, k: int
) -> list | None:
    """vLLM's `prompt_logprobs`: None for the first position, then per position
    {token id: {logprob, rank, decoded_token}}: the prompt token, then the k most likely."""
    if scored is None:
        return None
    out: list[dict | None] = []
    for i, t in enumerate(prompt_ids):
        if scored.token_logprobs[i] is None:
            out.append(None)
            continue
        entry = {str(t): _logprob(tok, t, scored.token_logprobs[i], scored.ranks[i])}
        for rank, (alt, v) in enumerate(scored.top[i][:k], start=1):
            entry.setdefault(str(alt), _logprob(tok, alt, v, rank))
        out.append(entry)
    return out


def _logprob(tok: Tokenizer, token_id: int, logprob: float, rank: int) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tok, token_id)}


def chat_logprobs(
    tok: Tokenizer, out: RequestOutput, start: int, end: int, top: int, index: int = 0
) -> ChatLogprobs | None:
    """Choice `index`'s chat `logprobs` for its tokens [start, end): each token with its
    logprob, its UTF-8 bytes and the `top` most likely alternatives (None: not asked for)."""
    lps = out.outputs[index].logprobs
    if lps is None:
        return None
    content = []
    for t, e in zip(out.outputs[index].token_ids[start:end], lps[start:end], strict=True):
        text = token_text(tok, t)
        alts = sorted(e.items(), key=lambda kv: -kv[1])[:top]
        tops = []
        for k, v in alts:
            alt = token_text(tok, k)
            tops.append(TopLogprob(token=alt, logprob=v, bytes=list(alt.encode())))
        content.append(
            TokenLogprob(token=text, logprob=e.get(t), bytes=list(text.encode()), top_logprobs=tops)
        )
    return ChatLogprobs(content=content)
