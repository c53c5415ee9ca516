"""`python -m benchmarks.chat_chunks`: a streamed chat token's event, written from the pydantic
chunk (`ChatCompletionChunk` + `event`) and straight from its text (`PlainChatChunks`), side
by side in one run: the server's CPU per token of a plain chat stream (issue 60).

Each side renders the same 32-output stream (one token and a few characters each, the first
with the role, the last with its finish) `--rounds` times; the figure is the best of 5 runs.
"""

from __future__ import annotations

import argparse
import timeit

from loraplex.engine import RequestOutput
from loraplex.engine.outputs import CompletionOutput
from loraplex.platform.openai.chat import TextStream
from loraplex.platform.openai.streaming import Envelope, event


def outputs(tokens: int) -> list[RequestOutput]:
    outs, text = [], ""
    for i in range(tokens):
        delta, done = f" word{i}", i == tokens - 1
        text += delta
        outs.append(RequestOutput(
            request_id="chatcmpl-1", prompt="p", prompt_token_ids=[9], finished=done,
            outputs=[CompletionOutput(0, text, list(range(i + 1)), "length" if done else None)],
            delta_text=delta, delta_token_ids=[i],
        ))  # fmt: skip
    return outs


def per_event_us(plain: bool, outs: list[RequestOutput], rounds: int) -> float:
    envelope = Envelope("chatcmpl-1", "chat.completion.chunk", 1700000000, "tenant/adapter")

    def stream() -> None:
        s = TextStream(envelope, None, tok=None, top=0, plain=plain)
        for out in outs:
            for chunk in s.chunks(out)[0]:
                event(chunk)

    best = min(timeit.repeat(stream, number=rounds, repeat=5))
    return best / (rounds * len(outs)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200, help="streams rendered per run")
    args = ap.parse_args()
    outs = outputs(32)
    before = per_event_us(False, outs, args.rounds)
    after = per_event_us(True, outs, args.rounds)
    print("| chat stream event | µs per token |\n| --- | --- |")
    print(f"| pydantic chunk + event | {before:.1f} |\n| PlainChatChunks | {after:.1f} |")
    print(f"\n(plain / pydantic: {after / before:.2f})")


if __name__ == "__main__":
    main()
