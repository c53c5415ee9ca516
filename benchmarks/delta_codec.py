"""`python -m benchmarks.delta_codec --against REV`: the engine -> server step messages of this
checkout's engine/process/output_deltas.py against those of git revision REV, on the same outputs.

One offline run of the tiny random Llama (`--requests` x `--tokens` greedy tokens) records every
step's RequestOutputs; each codec then encodes them as the engine process does
(`OutputEncoder` + `StepMessage.to_json`) and decodes them as the server does
(`StepMessage.from_json` + `OutputDecoder`), alternating (AB BA ...) `--repeats` times. Prints
microseconds per generated token of each half and the bytes per step message (medians), and
checks that both rebuild the same outputs.

    python -m benchmarks.delta_codec --against 3019852   # JSON objects (before issue 60)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--against", required=True, help="git revision of the other codec")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=6)


def _module(name: str, source: str, folder: Path):
    path = folder / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


def _steps(folder: Path, n: int, tokens: int) -> list:
    from benchmarks.assets import factories
    from loraplex.engine import LLM, SamplingParams

    model = factories().make_tiny_model("llama", folder / "llama",
                                        max_position_embeddings=tokens + 64)  # fmt: skip
    llm = LLM(str(model), dtype="float32", max_model_len=tokens + 64, num_threads=1)
    steps, step = [], llm.engine.step

    def recorded():
        outs = step()
        steps.append(copy.deepcopy(outs))  # the engine may go on extending an output
        return outs

    llm.engine.step = recorded
    llm.generate([[5, 17, 99, 3]] * n, SamplingParams(temperature=0, max_tokens=tokens,
                                                       ignore_eos=True))  # fmt: skip
    return steps


def _once(codec, steps: list, tokens: int) -> tuple[float, float, float, list]:
    encoder, decoder = codec.OutputEncoder(), codec.OutputDecoder()
    encode = decode = 0.0
    sizes, rebuilt = [], []
    for outs in steps:
        t0 = time.perf_counter()
        raw = codec.StepMessage(outputs=[encoder.encode(o) for o in outs]).to_json()
        t1 = time.perf_counter()
        rebuilt += [decoder.decode(d) for d in codec.StepMessage.from_json(raw).outputs]
        decode += time.perf_counter() - t1
        encode += t1 - t0
        sizes.append(len(raw))
    return 1e6 * encode / tokens, 1e6 * decode / tokens, statistics.median(sizes), rebuilt


def run(args: argparse.Namespace) -> dict:
    show = ["git", "-C", str(REPO), "show", f"{args.against}:engine/process/output_deltas.py"]
    other = subprocess.run(show, check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        codecs = {
            args.against: _module("codec_then", other, folder),
            "this checkout": _module(
                "codec_now", (REPO / "engine/process/output_deltas.py").read_text(), folder
            ),  # fmt: skip
        }
        steps = _steps(folder, args.requests, args.tokens)
    tokens = args.requests * args.tokens
    first = [_once(c, steps, tokens)[3] for c in codecs.values()]
    assert [vars(o) for o in first[0]] == [vars(o) for o in first[1]], "the outputs differ"
    runs: dict[str, list] = {name: [] for name in codecs}
    for i in range(args.repeats):
        for name in list(codecs) if i % 2 == 0 else list(codecs)[::-1]:
            runs[name].append(_once(codecs[name], steps, tokens)[:3])
    doc = {}
    for name, rs in runs.items():
        encode, decode, size = (statistics.median(r[k] for r in rs) for k in range(3))
        doc[name] = {"encode_us_per_token": encode, "decode_us_per_token": decode,
                     "bytes_per_step": size}  # fmt: skip
        print(f"{name}: encode {encode:.1f} µs/token, decode {decode:.1f} µs/token, "
              f"{size:,.0f} bytes per step message")  # fmt: skip
    return doc


def main(argv: list[str] | None = None) -> None:
    from benchmarks._cli import parser

    run(parser(__doc__, add_args).parse_args(argv))


if __name__ == "__main__":
    main()
