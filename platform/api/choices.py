"""The choices of an OpenAI-style answer, whole or as they stream: each choice's new text
and tokens since its previous chunk, a /v1/completions prompt's choices (echo, legacy
logprobs, vLLM's prompt_logprobs), and vLLM's continuous usage."""

from __future__ import annotations

from loraplex.engine.outputs import RequestOutput
from loraplex.platform.api.logprobs import LegacyLogprobs, joined, vllm_prompt_logprobs
from loraplex.platform.api.schemas import CompletionRequest


class ChoiceDeltas:
    """Streaming with n > 1: each choice's new text and tokens since its previous chunk (an
    unfinished sample's text only grows: the engine holds back possible stop strings)."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[int, int]] = {}  # index -> (chars, tokens) sent
        self.done: set[int] = set()

    def deltas(self, out: RequestOutput):
        """(index, new text, first new token, new tokens, finish_reason) per changed choice."""
        for c in out.outputs:
            chars, toks = self.sent.get(c.index, (0, 0))
            text, new = c.text[chars:], len(c.token_ids) - toks
            finish = c.finish_reason if c.index not in self.done else None
            if not text and not new and finish is None and c.index in self.sent:
                continue
            self.sent[c.index] = (len(c.text), len(c.token_ids))
            if finish is not None:
                self.done.add(c.index)
            yield c.index, text, toks, new, finish


class CompletionChoices:
    """One prompt's choices of a /v1/completions answer, whole or as they stream. With a list
    of prompts, prompt p's choices are numbered from p * n, as OpenAI's API and vLLM do."""

    def __init__(self, tok, body: CompletionRequest, prompt, prompt_ids, first: int) -> None:
        self.tok, self.body, self.prompt_ids, self.first = tok, body, prompt_ids, first
        # echo: the prompt goes before each choice's text (its first chunk when streamed)
        self.echo = "" if not body.echo else prompt if isinstance(prompt, str) else None
        if self.echo is None:
            self.echo = tok.decode(prompt_ids, skip_special_tokens=True)
        self.many = ChoiceDeltas()
        self.echoed: set[int] = set()
        self.streamed_logprobs: dict[int, LegacyLogprobs] = {}  # per choice, as it streams

    def _echoing(self, i: int, text: str) -> str:
        if self.echo and i not in self.echoed:
            self.echoed.add(i)
            return self.echo + text
        return text

    def _logprobs(self, out: RequestOutput, i: int, start: int, end: int, built=None):
        """Choice i's logprobs piece for its tokens [start, end) and the builder for its next
        piece; a choice's first piece starts with the prompt's (echo)."""
        c = out.outputs[i]
        ids, entries = c.token_ids[start:end], (c.logprobs or [])[start:end]
        if built is not None:
            return built.generated(ids, entries), built
        built = LegacyLogprobs(self.tok, self.prompt_ids, self.body.logprobs)
        first = built.echoed(out.prompt_logprobs, self.echo) if self.body.echo else {}
        return joined(first, built.generated(ids, entries)), built

    def _streamed(self, out: RequestOutput, i: int, start: int, end: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        piece, self.streamed_logprobs[i] = self._logprobs(
            out, i, start, end, self.streamed_logprobs.get(i)
        )
        return piece

    def chunk(self, out: RequestOutput) -> tuple[list[dict], int]:
        """The streamed choices `out` brings (none if nothing new) and the tokens they carry."""
        if self.body.n > 1:
            choices, total = [], 0
            for i, text, start, n, finish in self.many.deltas(out):
                lps = self._streamed(out, i, start, start + n)
                choices.append({"index": self.first + i, "text": self._echoing(i, text),
                                "logprobs": lps, "finish_reason": finish})  # fmt: skip
                total += n
            return choices, total
        n = len(out.delta_token_ids)
        start = len(out.outputs[0].token_ids) - n
        if not n and not out.finished and not out.delta_text:
            return [], 0
        choice = {
            "index": self.first,
            "text": self._echoing(0, out.delta_text),
            "logprobs": self._streamed(out, 0, start, start + n),
            "finish_reason": out.outputs[0].finish_reason if out.finished else None,
        }
        return [choice], n

    def whole(self, last: RequestOutput, i: int) -> dict:
        out = last.outputs[i]
        lps = None
        if self.body.logprobs is not None:
            lps = self._logprobs(last, i, 0, len(out.token_ids))[0]
        answer = {
            "index": self.first + i,
            "text": self.echo + out.text,
            "finish_reason": out.finish_reason,
            "logprobs": lps,
        }
        if self.body.prompt_logprobs is not None:  # vLLM's extension, on each choice as vLLM's
            answer["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tok, self.prompt_ids, last.prompt_logprobs, self.body.prompt_logprobs
            )
        return answer


class RunningUsage:
    """vLLM's `stream_options.continuous_usage_stats`: each chunk's usage, as of that chunk."""

    def __init__(self, job) -> None:
        self.job, self.completion = job, 0

    def add(self, chunk: dict | list | None, tokens: int) -> None:
        self.completion += tokens
        prompt = len(self.job.prompt_ids)
        for part in chunk if isinstance(chunk, list) else [chunk] if chunk else []:
            part["usage"] = {"prompt_tokens": prompt, "completion_tokens": self.completion,
                             "total_tokens": prompt + self.completion}  # fmt: skip
