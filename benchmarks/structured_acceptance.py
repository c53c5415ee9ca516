"""Acceptance of structured output: JSON that validates, for every request, through the client.

A `loraplex serve` subprocess on the demo model (Gemma 3 270M) with the demo adapters
(`pirate`, `shout`) gets `--requests` requests (default 200) from the official `openai` client,
`--concurrency` in flight: every combination of base model / adapter, streamed or not,
/v1/chat/completions or /v1/completions, over four JSON schemas (`response_format`
json_schema; in `extra_body` on completions, where the client has no such parameter).
Each answer is parsed and validated with `jsonschema`. The schemas bound every string,
array and integer so that an answer closes well within `--max-tokens`: an answer cut by
max_tokens (finish_reason "length") is counted apart from an invalid one.

    .venv/bin/python -m benchmarks.structured_acceptance --data-dir DATA
    .venv/bin/python -m benchmarks.structured_acceptance --requests 24 --out /tmp/acc.json

Prints the counts and writes `--out` (JSON). Exits 1 unless every answer validated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

SCHEMAS = {
    "city": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
            "capital": {"type": "boolean"},
        },
        "required": ["name", "population", "capital"],
        "additionalProperties": False,
    },
    "person": {
        "type": "object",
        "properties": {
            "first_name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["captain", "cook", "navigator", "engineer"]},
        },
        "required": ["first_name", "age", "role"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "tags": {
                "type": "array",
                "items": {"enum": ["price", "service", "food", "view"]},
                "maxItems": 3,
            },
        },
        "required": ["rating", "sentiment", "tags"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "express": {"type": "boolean"},
        },
        "required": ["order_id", "items", "express"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "city": "Describe the city of {x} as JSON.",
    "person": "Describe the ship's crew member number {x} as JSON.",
    "review": "Write a short review of restaurant {x} as JSON.",
    "order": "Write order number {x} of the shop as JSON.",
}
ADAPTERS = ("pirate", "shout")


def plan(n: int, base_model: str) -> list[dict]:
    """n requests cycling through model x stream x endpoint x schema (3 x 2 x 2 x 4)."""
    models = [base_model, *ADAPTERS]
    names = list(SCHEMAS)
    out = []
    for i in range(n):
        out.append({
            "i": i,
            "model": models[i % 3],
            "stream": (i // 3) % 2 == 1,
            "endpoint": "chat" if (i // 6) % 2 == 0 else "completions",
            "schema": names[(i // 12) % 4],
        })  # fmt: skip
    return out


async def one(client, req: dict, max_tokens: int, temperature: float) -> dict:
    import jsonschema

    schema = SCHEMAS[req["schema"]]
    fmt = {"type": "json_schema", "json_schema": {"name": req["schema"], "schema": schema}}
    prompt = PROMPTS[req["schema"]].format(x=req["i"])
    kw = dict(model=req["model"], max_tokens=max_tokens, temperature=temperature, seed=req["i"])
    t0 = time.perf_counter()
    text, reason, tokens = "", None, None
    try:
        if req["endpoint"] == "chat":
            kw.update(messages=[{"role": "user", "content": prompt}], response_format=fmt)
            create = client.chat.completions.create
        else:
            kw.update(prompt=prompt + "\n", extra_body={"response_format": fmt})
            create = client.completions.create
        if req["stream"]:
            parts = []
            stream = await create(**kw, stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for c in chunk.choices:
                    parts.append(c.text if req["endpoint"] == "completions" else c.delta.content)
                    reason = c.finish_reason or reason
            text = "".join(p or "" for p in parts)
        else:
            r = await create(**kw)
            c = r.choices[0]
            text = c.text if req["endpoint"] == "completions" else c.message.content
            reason, tokens = c.finish_reason, r.usage.completion_tokens
    except Exception as e:  # an error is a result to count, not a crash of the run
        return {**req, "outcome": "error", "error": f"{type(e).__name__}: {e}"[:300]}
    seconds = time.perf_counter() - t0
    result = {**req, "finish_reason": reason, "completion_tokens": tokens, "text": text,
              "seconds": round(seconds, 3)}  # fmt: skip
    if reason == "length":
        return {**result, "outcome": "length"}
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return {**result, "outcome": "invalid", "error": str(e).split("\n")[0][:300]}
    return {**result, "outcome": "valid"}


async def run_all(url: str, key: str, reqs: list[dict], args) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=900)
    gate = asyncio.Semaphore(args.concurrency)

    async def gated(req):
        async with gate:
            return await one(client, req, args.max_tokens, args.temperature)

    try:
        return await asyncio.gather(*(gated(r) for r in reqs))
    finally:
        await client.close()


def summarize(results: list[dict]) -> dict:
    def count(rows):
        out = {k: 0 for k in ("valid", "invalid", "length", "error")}
        for r in rows:
            out[r["outcome"]] += 1
        return out

    by = {}
    for key in ("model", "stream", "endpoint", "schema"):
        for value in sorted({str(r[key]) for r in results}):
            by[f"{key}={value}"] = count([r for r in results if str(r[key]) == value])
    return {"total": count(results), "by": by}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", default="/tmp/loraplex-bench", help="where the demo model is")
    ap.add_argument("--model", help="model folder (default: the demo model under --data-dir)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--out", default="benchmarks/results/structured-acceptance.json")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tempfile

    import torch

    from benchmarks.server import LoraplexServer
    from benchmarks.structured import _cpu_name
    from loraplex.bench import sysinfo
    from loraplex.engine.models.demo import prepare_demo
    from loraplex.platform.demo.adapters import prepare_demo_adapters

    data = Path(args.data_dir)
    model = Path(args.model) if args.model else prepare_demo(data, progress=False)
    adapters = prepare_demo_adapters(model, data / "demo-adapters", progress=False)
    with tempfile.TemporaryDirectory(prefix="loraplex-acceptance-") as run_dir:
        srv = LoraplexServer(model, Path(run_dir), max_num_seqs=max(args.concurrency, 16))
        with srv:
            for name in ADAPTERS:
                srv.upload(name, adapters[name])
            reqs = plan(args.requests, srv.model_name)
            t0 = time.perf_counter()
            results = asyncio.run(run_all(srv.url, srv.api_key, reqs, args))
            wall = time.perf_counter() - t0
    summary = summarize(results)
    tokens = sum(r.get("completion_tokens") or 0 for r in results)
    machine = f"{_cpu_name()}, {os.cpu_count()} cpus, {torch.get_num_threads()} torch threads"
    total = summary["total"]
    print(f"model {model.name} + adapters {', '.join(ADAPTERS)}; {machine}")
    print(f"{args.requests} requests, {args.concurrency} in flight, max_tokens {args.max_tokens}, "
          f"{wall:.1f} s, {tokens} completion tokens ({tokens / wall:.1f} tok/s)")  # fmt: skip
    print(f"valid {total['valid']} / {len(results)}  invalid {total['invalid']}  "
          f"cut by max_tokens {total['length']}  errors {total['error']}")  # fmt: skip
    for key, c in summary["by"].items():
        print(f"  {key:22s} " + "  ".join(f"{k} {v}" for k, v in c.items()))
    for r in results:
        if r["outcome"] != "valid":
            print(f"  #{r['i']} {r['outcome']}: {r.get('error', '')} {r.get('text', '')[:120]!r}")
    out = {
        "what": "response_format json_schema through the openai client; jsonschema validation",
        "model": model.name,
        "adapters": list(ADAPTERS),
        "machine": sysinfo.machine(),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "wall_s": round(wall, 1),
        "completion_tokens": tokens,
        "summary": summary,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if total["valid"] == len(results) else 1


def section(doc: dict, path: Path, out: Path) -> str:
    """benchmarks/docs.py's section for a results file of this benchmark."""
    t = doc["summary"]["total"]
    by = doc["summary"]["by"]
    rows = "".join(
        f"| {k} | {c['valid']} | {c['invalid']} | {c['length']} | {c['error']} |\n"
        for k, c in by.items()
    )
    longest = max((r.get("completion_tokens") or 0) for r in doc["results"])
    return (
        f"### `{path.name}`: {doc['model']} + adapters {', '.join(doc['adapters'])}\n\n"
        f"{doc['requests']} requests through the `openai` client, {doc['concurrency']} in "
        "flight, `response_format` json_schema (four schemas with bounded strings, arrays and "
        "integers), base model and adapters, streamed or not, chat and completions; each "
        f"answer parsed and validated with `jsonschema`. Temperature {doc['temperature']}, "
        f"max_tokens {doc['max_tokens']} (the longest answer: {longest} tokens). "
        f"{doc['wall_s']} s, {doc['completion_tokens']} completion tokens on a shared "
        "machine.\n\n"
        f"**Valid: {t['valid']} / {doc['requests']}** (invalid {t['invalid']}, cut by "
        f"max_tokens {t['length']}, errors {t['error']}).\n\n"
        "| slice | valid | invalid | cut by max_tokens | errors |\n"
        "| --- | --- | --- | --- | --- |\n" + rows
    )


if __name__ == "__main__":
    raise SystemExit(main())
