"""Helpers shared by the tests of the in-thread and the out-of-process engine."""

from __future__ import annotations

import asyncio


def read_then_hang_up(engine, prompt: str, params, n: int) -> int:
    """Read `n` outputs of one stream, then leave it as a client that goes away would;
    returns how many were read."""

    async def main():
        got = 0
        async for _ in engine.generate(prompt, params):
            got += 1
            if got == n:
                break
        return got

    return asyncio.run(main())
