"""Structured output: decode step time with every row grammar-constrained vs none.

`--batch` requests (default 32) decode together on one model (default: the demo Gemma 3 270M,
prepared under `--data-dir`, vocabulary 262,144). Every step of the constrained run fills one
xgrammar bitmask row per request and masks the logits; the free run is the same batch with no
processors (the sampler's argmax fast path). The grammar is a JSON schema that cannot finish
within `--tokens` (an array with minItems 1000 of objects), so all rows stay in the batch, and
only steps with the whole batch decoding are timed. Runs alternate free/constrained `--repeats`
times (ABBA; the machine is shared) and each run's median step is kept; prints both medians,
the ratio and the machine.

    .venv/bin/python -m benchmarks.structured
    .venv/bin/python -m benchmarks.structured --model /path/to/model --batch 8 --tokens 32
    .venv/bin/python -m benchmarks.structured --out benchmarks/results/structured-bitmask-demo.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "tags"],
    },
}


def _steps(llm, batch: int, tokens: int, spec: dict | None) -> list[float]:
    """Seconds of each engine step that decoded the whole batch."""
    from loraplex.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(
        temperature=0,
        max_tokens=tokens,
        ignore_eos=True,
        logits_processors=[spec] if spec else None,
    )
    for i in range(batch):
        engine.add_request(f"r{i}", f"Record {i} of the people list, as JSON:", params)
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        decoding = [o for o in outs if len(o.outputs[0].token_ids) > 1]
        if len(decoding) == batch:
            times.append(dt)
    return times


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model folder (default: the demo model)")
    ap.add_argument("--data-dir", default="/tmp/loraplex-bench", help="where the demo model is")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--out", help="also write the result here (JSON; benchmarks/results/structured-*)"
    )
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from loraplex.engine import LLM
    from loraplex.engine.sampling.structured_output import grammar_spec

    model = args.model
    if model is None:
        from loraplex.engine.models.demo import prepare_demo

        model = str(prepare_demo(Path(args.data_dir), progress=False))
    llm = LLM(model, dtype=args.dtype, max_num_seqs=max(args.batch, 64))
    spec = grammar_spec("json_schema", SCHEMA)
    # Warm up both paths at full batch: xgrammar's import, tokenizer info and compile; the
    # batch's first shapes.
    _steps(llm, args.batch, 4, spec)
    _steps(llm, args.batch, 4, None)

    free: list[float] = []
    constrained: list[float] = []
    order = (["free", "constrained", "constrained", "free"] * args.repeats)[: 2 * args.repeats]
    for run in order:
        times = _steps(llm, args.batch, args.tokens, spec if run == "constrained" else None)
        (constrained if run == "constrained" else free).append(statistics.median(times))
    f, c = statistics.median(free), statistics.median(constrained)
    import torch

    device = f"{_cpu_name()}, {os.cpu_count()} cpus, {torch.get_num_threads()} torch threads"
    vocab = llm.engine.vocab_size
    print(f"model {Path(model).name} (vocab {vocab}), batch {args.batch}, {args.dtype}, {device}")
    print(f"decode step, free:        {f * 1000:8.1f} ms  (median of {len(free)} runs)")
    print(f"decode step, constrained: {c * 1000:8.1f} ms  (median of {len(constrained)} runs)")
    print(f"constrained / free:       {c / f:8.3f}  ({(c / f - 1) * 100:+.1f} %)")
    if args.out:
        import json

        from loraplex.bench import sysinfo

        doc = {
            "model": Path(model).name,
            "vocab": vocab,
            "batch": args.batch,
            "tokens": args.tokens,
            "dtype": args.dtype,
            "machine": sysinfo.machine(),
            "free_ms": [round(t * 1000, 2) for t in free],
            "constrained_ms": [round(t * 1000, 2) for t in constrained],
            "ratio": round(c / f, 4),
        }
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")


def section(doc: dict, path: Path, out: Path) -> str:
    """benchmarks/docs.py's section for a results file of this benchmark."""
    f, c = statistics.median(doc["free_ms"]), statistics.median(doc["constrained_ms"])
    return (
        f"### `{path.name}`: {doc['model']} (vocabulary {doc['vocab']:,}), batch "
        f"{doc['batch']}, {doc['dtype']}\n\n"
        "Decode step time with every row constrained by a JSON schema (xgrammar bitmask filled "
        "per row, logits masked) vs the same batch unconstrained; runs alternate (ABBA), "
        "median step of each run, median of the runs. Goal: at most +10 %.\n\n"
        "| free (ms) | constrained (ms) | constrained / free |\n| --- | --- | --- |\n"
        f"| {f:.1f} | {c:.1f} | {doc['ratio']:.3f} ({(doc['ratio'] - 1) * 100:+.1f} %) |\n\n"
        f"Runs, free: {doc['free_ms']}; constrained: {doc['constrained_ms']} (a shared "
        "machine: the step time moves with its load; the ratio is within a run pair).\n"
    )


if __name__ == "__main__":
    main()
