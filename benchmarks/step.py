"""Host time and aten ops per decode step on a skinny 8B-layout Llama: this checkout vs a baseline.

    python -m benchmarks.step                          # vs 9967067; batch 1/16/64 x 0/4/32 adapters
    python -m benchmarks.step --baseline HEAD~3 --batches 64 --adapters 32 --repeats 7
    python -m benchmarks.step --no-baseline --layers 2 # this checkout only, quick
    python -m benchmarks.step --model tiny-llama --dtype bfloat16 --no-baseline --batches 64 \
        --adapters 0,4                                 # the peers benchmark's model, where
                                                       # the products are most of a step

The model has Llama-3-8B's layout (32 layers, 32 query / 8 KV heads, SwiGLU, untied) at tiny
widths (hidden 64, head_dim 8, FFN 128, vocab 512), float32, so a step's arithmetic is
negligible and its time is the engine's own host work (Python, dispatch, per-step metadata)
and what each op costs whatever its size (per call, and the adapters' stacks it reads: the
sampled split below says how much of a step each is). Adapters are
PEFT LoRA of rank 16 on all seven projections (q/k/v/o/gate/up/down); row i of a batch uses
adapter i mod N (N = 0: every row on the base model, LoRA still enabled with 32 slots).
`--model tiny-llama` measures the peer comparisons' tiny Llama instead (`python -m
benchmarks.peers`, benchmarks/assets.py; 4 layers, hidden 512, vocab 32k), in `--dtype`: there
the step's products dominate, and the page's floor says how much of a step torch's kernels
leave to everything else.

Each configuration and each source tree runs in its own subprocess with one compute thread
(`torch.set_num_threads(1)`, OMP/MKL threads 1), so the two trees get the same machine and
neither one's imports, caches or allocator state leak into the other. The baseline commit's
tree comes out of `git archive` into a temporary folder; a `loraplex` package whose
subpackages link to that tree's folders (the mapping in its own pyproject.toml) goes first on
the subprocess's sys.path, and the subprocess reports the file it imported `loraplex.engine`
from so the run proves which copy it measured. The current tree (uncommitted edits included)
goes through the same mechanism.

Per subprocess: every row is prefilled, `--warmup` decode steps run, then `--repeats` rounds of
`--steps` timed `LLMEngine.step()` calls (the whole step: scheduling, adapter bookkeeping, the
forward, sampling, outputs), each timed in wall time and in the process's CPU time (which
leaves out the time other processes held the core: the steadier figure on a shared machine);
ms/step is the median over rounds of each round's median. Then `--profile-steps` more steps
run under torch.profiler (CPU) and its aten events are counted per step: every dispatched aten
op (nested ones included), the same without pure view ops (ops whose schema says the result
aliases an input: view, reshape, transpose, select, slice, expand, ...; when one of them has to
copy, the copy is its own op and still counts), and the top-level ones (not called from inside
another aten op). Then `--sample-steps` more steps run while py-spy (`--native`, at
`--sample-rate` per second) samples the worker's stacks, which it does at no cost per op: each
sample inside `LLMEngine.step` is inside an ATen op, in torch's dispatch and bindings, or in
the engine's Python (`classify_stack`), so the page can say how much of a step the ops
themselves take, whatever the host does around them.

The current tree's subprocess also measures a floor under any step built from torch's CPU
kernels at the same shapes (`kernel_floor`: attention's and the base model's products alone,
back to back, and the used adapters' bytes at the core's read bandwidth; everything else free),
so the page says how far a step is from what these kernels allow, and whether a target is
below it.

Writes benchmarks/results/step-overhead.json, docs/step-overhead.md and docs/step-overhead.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"
CACHE_DIR = BENCH_DIR / ".cache"
RESULTS_JSON = BENCH_DIR / "results" / "step-overhead.json"
DOC = REPO / "docs" / "step-overhead.md"
FIGURE = REPO / "docs" / "step-overhead.png"
DEFAULT_BASELINE = "9967067"  # the checkout before issue 36's step restructuring
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Llama-3-8B's layout at widths where compute is negligible
SKINNY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=32,
              num_key_value_heads=8, head_dim=8, vocab_size=512)  # fmt: skip
MODELS = ("skinny", "tiny-llama")  # --model: the skinny layout, or the peers' tiny Llama
DTYPES = ("float32", "bfloat16")
STEP_DIRS = ("engine", "kernels")  # the folders whose code a decode step runs
SLOTS = 32  # adapter slots of every engine here, whatever the traffic uses
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
RESULT_TAG = "STEP-RESULT "  # the worker's one line of JSON on stdout


# ---------------------------------------------------------------- assets


def build_assets(layers: int, adapters: int, rank: int, cache: Path = CACHE_DIR,
                 model_name: str = "skinny"):  # fmt: skip
    """The model folder (the skinny one of `layers` layers, or the peer comparisons' tiny Llama) and
    `adapters` PEFT folders for it (built once, cached)."""
    from benchmarks.assets import import_installed_kernels, tiny_llama

    import_installed_kernels()  # transformers' `kernels`, not this checkout's kernels/ folder
    from testkit.factories import make_adapter, make_tiny_model

    if model_name == "tiny-llama":
        root = cache / "step-tiny-llama"
        model = tiny_llama()
    else:
        root = cache / f"step-skinny-l{layers}"
        model = root / "model"
        if not (model / ".done").is_file():
            shutil.rmtree(model, ignore_errors=True)
            make_tiny_model("llama", model, num_layers=layers, **SKINNY)
            (model / ".done").write_text("")
    paths = []
    for i in range(adapters):
        out = root / f"adapter-r{rank}-{i:02d}"
        paths.append(out)
        if not (out / ".done").is_file():
            shutil.rmtree(out, ignore_errors=True)
            # init_std keeps deltas small next to the 0.08-std base weights over 32 layers
            make_adapter(model, out, r=rank, alpha=2 * rank, targets=TARGETS, seed=1 + i,
                         init_std=0.02)  # fmt: skip
            (out / ".done").write_text("")
    return model, paths


# ---------------------------------------------------------------- source trees


def resolve_commit(rev: str, repo: Path = REPO) -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"unknown baseline commit {rev!r}: {out.stderr.strip()}")
    return out.stdout.strip()


def package_dirs(root: Path) -> dict[str, str]:
    """`loraplex.<name>` -> folder, from the tree's own pyproject (its layout at that commit)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = project["tool"]["setuptools"]["package-dir"]
    return {k.split(".", 1)[1]: v for k, v in mapping.items() if k.count(".") == 1}


@contextlib.contextmanager
def source_tree(commit: str, repo: Path = REPO):
    """The commit's files in a temporary folder. `git archive` reads objects only: the shared
    checkout's index, worktree list and HEAD stay untouched, and nothing is left behind if the
    run is killed but a folder in the temp directory."""
    tmp = Path(tempfile.mkdtemp(prefix=f"step-{commit[:9]}-"))
    try:
        archive = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", commit],
                                   stdout=subprocess.PIPE)  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=archive.stdout, check=True)
        archive.stdout.close()
        if archive.wait() != 0:
            raise RuntimeError(f"git archive {commit} failed")
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_shim(root: Path, shim: Path) -> Path:
    """A folder holding a `loraplex` package whose subpackages are links to `root`'s folders.

    First on sys.path, it wins over the editable install's finder (a meta-path hook consulted
    after the path finder), so `import loraplex.engine` gets `root`'s copy."""
    pkg = shim / "loraplex"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for name, folder in package_dirs(root).items():
        (pkg / name).symlink_to(root / folder, target_is_directory=True)
    return shim


# ---------------------------------------------------------------- op counting


_VIEW_CACHE: dict[str, bool] = {}


def is_view_op(event_name: str) -> bool:
    """Whether a profiler event's aten op only aliases its input: the schema of every overload
    that takes tensors marks an argument as aliased by the result and not written
    (`Tensor(a) self`)."""
    if event_name in _VIEW_CACHE:
        return _VIEW_CACHE[event_name]
    import torch

    view = False
    if event_name.startswith("aten::"):
        packet = getattr(torch.ops.aten, event_name[len("aten::") :], None)
        overloads = [getattr(packet, o) for o in packet.overloads()] if packet else []
        # only the tensor forms: `aten::slice` also has TorchScript list/str overloads
        tensor_forms = [
            o
            for o in overloads
            if any(str(a.type).startswith("Tensor") for a in o._schema.arguments)
        ]
        view = bool(tensor_forms) and all(o.is_view for o in tensor_forms)
    _VIEW_CACHE[event_name] = view
    return view


def count_ops(events) -> dict[str, int]:
    """aten op counts of torch.profiler FunctionEvents: all, without views, top-level."""
    total = no_view = top = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        total += 1
        no_view += not is_view_op(e.name)
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        top += parent is None
    return {"aten": total, "aten_no_view": no_view, "aten_top": top}


def lora_stack_bytes(model) -> int:
    """Bytes of every LoRA module's A and B slot stacks: what a step whose rows use every
    slot reads at least once (fused projections keep each slice's B rows in the columns of
    the whole output, zeros elsewhere, and those zeros are read too)."""
    import torch

    stacks = (getattr(m, name, None) for m in model.modules() for name in ("lora_a", "lora_b"))
    return sum(t.nbytes for t in stacks if isinstance(t, torch.Tensor))


def read_bandwidth(mbytes: int = 256, repeats: int = 3) -> float:
    """GB/s one thread reads a float32 tensor far larger than the caches at (torch.sum)."""
    import torch

    x = torch.ones(mbytes * (1 << 20) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9


def _per_call_ms(fn, calls: int = 40, rounds: int = 5) -> float:
    """Fastest round's mean ms per call of `fn` called back to back (after one warm-up call):
    kernels alone, with no engine Python between them and their inputs hot in the caches."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def adapter_elements(paths: list[str]) -> int:
    """A and B elements of PEFT adapter folders, as stored (each target's own rank and widths:
    none of the zeros a fused projection's slot stack keeps between its slices)."""
    from safetensors import safe_open

    total = 0
    for folder in paths:
        with safe_open(str(Path(folder) / "adapter_model.safetensors"), framework="pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            total += sum(math.prod(f.get_slice(n).get_shape()) for n in names)
    return total


def _product_ms(x, w) -> float:
    """x w^T in the fastest of the forms the engine may run it in on this CPU: F.linear,
    oneDNN's packed weight where the CPU packs the dtype (what the engine's packed layers and
    head run), and for a half-precision model also in float32 (the engine's compute on a CPU
    without half matmuls); `benchmarks.roofline._forms`, as the compute ceiling takes them."""
    import torch

    from benchmarks.roofline import _forms

    cases = [(fn, x) for fn in _forms(w).values()]
    if w.dtype != torch.float32:
        cases += [(fn, x.float()) for fn in _forms(w.float()).values()]
    return min(_per_call_ms(lambda fn=fn, xs=xs: fn(xs)) for fn, xs in cases)


def kernel_floor(spec, batch: int, adapter_paths: list[str], context: int, dtype,
                 read_gbps: float) -> dict:  # fmt: skip
    """A floor under any decode step at this configuration built from torch's CPU kernels: the
    least one step's essential products take with nothing between them.

    Per layer, attention's arithmetic on keys and values already contiguous (no gather from
    the paged cache, no KV write) in the fastest of torch's forms (sdpa with the grouped
    query heads folded into rows, with or without a mask; two batched matmuls and a softmax)
    and the base model's four products (q|k|v, o, gate|up, down); once a step the LM head
    (each product in the fastest of torch's forms here: `_product_ms`); the adapters' A and B
    as PEFT stores them (no zeros), read once at the core's bandwidth (`read_gbps`, from
    `read_bandwidth`) and not multiplied. Left out as free: norms, RoPE, SiLU, residual adds,
    the KV write and gathers, sampling, the engine's Python, torch's dispatch. Every real
    step does more, so a target below this floor cannot be met with these kernels."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    b, kvh, d = max(batch, 1), spec.num_kv_heads, spec.head_dim
    g, length = spec.num_heads // spec.num_kv_heads, context
    q, k, v = rand(b, kvh, g, d), rand(b, kvh, length, d), rand(b, kvh, length, d)
    scale = d**-0.5
    bias = torch.zeros(b, 1, 1, length, dtype=dtype)
    qb, kb, vb = q.view(b * kvh, g, d), k.view(b * kvh, length, d), v.view(b * kvh, length, d)
    forms = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale),
        "sdpa, masked": lambda: F.scaled_dot_product_attention(q, k, v, bias, scale=scale),
        "matmul": lambda: torch.bmm((torch.bmm(qb, kb.mT) * scale).softmax(-1), vb),
    }
    attention = {name: _per_call_ms(fn) for name, fn in forms.items()}
    h, qs, kvs = spec.hidden_size, spec.num_heads * d, spec.num_kv_heads * d
    f = spec.intermediate_size
    x_h, x_q, x_f = rand(b, h), rand(b, qs), rand(b, f)
    weights = [(x_h, rand(qs + 2 * kvs, h)), (x_q, rand(h, qs)), (x_h, rand(2 * f, h)),
               (x_f, rand(h, f))]  # fmt: skip
    linears = sum(_product_ms(x, w) for x, w in weights)
    head = _product_ms(x_h, rand(spec.vocab_size, h))
    used = adapter_paths[: min(len(adapter_paths), b)]  # rows use adapter i mod N
    lora_bytes = adapter_elements(used) * torch.finfo(dtype).bits // 8
    lora = lora_bytes / read_gbps / 1e6
    per_layer = min(attention.values()) + linears
    return {
        "context": length,
        "attention_ms_per_layer": attention,
        "linears_ms_per_layer": linears,
        "head_ms": head,
        "lora_bytes": lora_bytes,
        "read_gbps": read_gbps,
        "lora_read_ms": lora,
        "floor_ms": spec.num_layers * per_layer + head + lora,
    }


def time_split(events, steps: int, top: int = 8) -> dict:
    """Where a profiled step's time goes: the self CPU time of aten ops per step (the kernels'
    work and their dispatch inside torch), the top ops by it, and the step's time outside
    any aten op (Python: the engine's own host work between ops)."""
    own: dict[str, float] = {}
    for e in events:
        if e.name.startswith("aten::"):
            own[e.name] = own.get(e.name, 0.0) + e.self_cpu_time_total / 1e3  # us -> ms
    total = sum(own.values()) / steps
    ranked = sorted(own.items(), key=lambda kv: -kv[1])[:top]
    return {"aten_ms": total, "top": [(name, ms / steps) for name, ms in ranked]}


# Native frames of ATen's CPU implementations (and MKL, oneDNN and SLEEF under them): a sample
# with one of these below its innermost Python frame is time inside an op (its kernel and its
# own per-call C++); other native frames there are torch's dispatch and its Python bindings.
KERNEL_FRAME = re.compile(r"at::native::|at::internal::|at::vec::|cpublas|mkl_|dnnl|sleef|gemm")
PY_FRAME = re.compile(r"\.py:\d+\)$")
STEP_FRAME = "LLMEngine.step ("
SAMPLE_KINDS = ("kernels", "dispatch", "python")


def classify_stack(frames: list[str]) -> str:
    """One py-spy --native sample (outermost frame first): inside an ATen op's CPU code (its
    kernel and its own per-call C++), in torch's dispatch and bindings, or in the Python
    interpreter (the engine's own code)."""
    py = [i for i, f in enumerate(frames) if PY_FRAME.search(f)]
    below = frames[py[-1] + 1 :] if py else frames
    if all("libpython" in f for f in below):
        return "python"
    if any(KERNEL_FRAME.search(f) for f in below):
        return "kernels"
    return "dispatch"


def split_samples(raw: str) -> dict[str, int]:
    """Counts per kind of py-spy's raw output (`frame;frame;... count` per line), only the
    samples taken inside `LLMEngine.step` (not the idle threads nor the benchmark's loop)."""
    counts = dict.fromkeys(SAMPLE_KINDS, 0)
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if n.isdigit() and any(f.startswith(STEP_FRAME) for f in frames):
            counts[classify_stack(frames)] += int(n)
    return counts


def sample_steps(step, steps: int, rate: int) -> dict | None:
    """Run `steps` engine steps while py-spy samples this process's native and Python stacks:
    the share of the step spent inside ATen ops, in torch's dispatch and bindings, and in
    the engine's Python, without the per-op cost torch.profiler adds. py-spy pauses the
    process to read each sample, and code resumed after a pause runs colder, so a high rate
    inflates the host's share: the default rate is low and the steps many."""
    if steps <= 0:
        return None
    local = Path(sys.executable).with_name("py-spy")
    exe = str(local) if local.exists() else shutil.which("py-spy")
    if exe is None:
        return {"error": "py-spy not found (pip install py-spy)"}
    with tempfile.TemporaryDirectory(prefix="step-spy-") as tmp:
        out = Path(tmp) / "samples.txt"
        cmd = [exe, "record", "--pid", str(os.getpid()), "--native", "--rate", str(rate),
               "--format", "raw", "--output", str(out), "--duration", "600"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        time.sleep(1.0)  # attached by then; samples outside LLMEngine.step are not counted
        start = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - start
        proc.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return {"error": "py-spy did not exit"}
        if not out.exists():
            return {"error": "py-spy wrote nothing: " + (err or "").strip()[-300:]}
        counts = split_samples(out.read_text())
    total = sum(counts.values())
    if not total:
        return {"error": "no sample inside LLMEngine.step"}
    return {"samples": total, "rate": rate, "sampled_ms_per_step": elapsed * 1e3 / steps,
            "shares": {k: v / total for k, v in counts.items()}}  # fmt: skip


# ---------------------------------------------------------------- the worker (one subprocess)


def worker(cfg: dict) -> dict:
    """Build an engine from the `loraplex` on sys.path and measure decode steps."""
    import importlib.util

    # Which copy `import loraplex.engine` will load, before paying for torch's import
    spec = importlib.util.find_spec("loraplex.engine")
    origin = str(Path(spec.origin).resolve()) if spec and spec.origin else str(spec)
    if not origin.startswith(str(Path(cfg["root"]).resolve()) + os.sep):
        raise RuntimeError(f"imported loraplex.engine from {origin}, not {cfg['root']}")
    import torch

    from benchmarks.assets import import_installed_kernels

    import_installed_kernels()  # in case the engine's imports pull in transformers
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set by an earlier import's parallel work
        torch.set_num_interop_threads(1)
    import dataclasses

    import loraplex.engine as engine_pkg
    from loraplex.engine import LLM, LoRARequest, SamplingParams
    from loraplex.engine.config import EngineConfig

    imported = str(Path(engine_pkg.__file__).resolve())
    if not imported.startswith(str(Path(cfg["root"]).resolve()) + os.sep):
        raise RuntimeError(f"imported loraplex.engine from {imported}, not {cfg['root']}")
    batch = cfg["batch"]
    timed = cfg["repeats"] * cfg["steps"]
    steps_needed = cfg["warmup"] + timed + cfg["profile_steps"] + cfg.get("sample_steps", 0)
    prompt_len = cfg["prompt_len"]
    options = dict(dtype=cfg.get("dtype", "float32"), device="cpu", max_loras=SLOTS,
                   max_lora_rank=cfg["rank"],
                   max_num_seqs=max(batch, 1), max_model_len=prompt_len + steps_needed + 32,
                   max_num_batched_tokens=max(2048, batch * prompt_len), num_threads=1,
                   kv_cache_bytes=512 << 20, cpu_attention=cfg["cpu_attention"],
                   enable_prefix_caching=False, seed=0)  # fmt: skip
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    dropped = sorted(k for k in options if k not in known)
    options = {k: v for k, v in options.items() if k in known}
    max_loras, max_rank = options.pop("max_loras"), options.pop("max_lora_rank")
    llm = LLM(cfg["model"], max_loras=max_loras, max_lora_rank=max_rank, **options)
    engine = llm.engine
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(cfg["adapter_paths"])]
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps_needed + 8, ignore_eos=True)
    produced = {}
    for i in range(batch):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=gen).tolist()
        rid = f"r{i}"
        engine.add_request(rid, prompt, params, reqs[i % len(reqs)] if reqs else None)
        produced[rid] = 0

    def step() -> None:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)

    for _ in range(200):  # prefill (chunks) until every row has its first token
        if min(produced.values()) > 0:
            break
        step()
    else:
        raise RuntimeError("prefill did not finish in 200 steps")
    for _ in range(cfg["warmup"]):
        step()
    rounds, cpu_rounds = [], []
    for _ in range(cfg["repeats"]):
        times, cpu = [], []
        for _ in range(cfg["steps"]):
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        rounds.append(statistics.median(times))
        cpu_rounds.append(statistics.median(cpu))
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(cfg["profile_steps"]):
            step()
    profiled_ms = (time.perf_counter() - start) * 1e3 / cfg["profile_steps"]
    counts = count_ops(prof.events())
    time_by_op = time_split(prof.events(), cfg["profile_steps"])
    sampled = sample_steps(step, cfg.get("sample_steps", 0), cfg.get("sample_rate", 50))
    gbps = read_bandwidth()
    floor = None
    if cfg.get("floor"):  # at the timed steps' middle context (prompt, first token, steps)
        middle = prompt_len + 1 + cfg["warmup"] + cfg["repeats"] * cfg["steps"] // 2
        floor = kernel_floor(engine.model.spec, batch, cfg["adapter_paths"], middle,
                             engine.model.dtype, gbps)  # fmt: skip
    if min(produced.values()) < steps_needed:  # every row decoded through every step
        raise RuntimeError(f"rows stopped early: {min(produced.values())} < {steps_needed}")
    return {
        "imported_from": imported,
        "torch_threads": torch.get_num_threads(),
        "ms_per_step": statistics.median(rounds) * 1e3,
        "ms_rounds": [r * 1e3 for r in rounds],
        "cpu_ms_per_step": statistics.median(cpu_rounds) * 1e3,
        "cpu_ms_rounds": [r * 1e3 for r in cpu_rounds],
        "ops_per_step": {k: v / cfg["profile_steps"] for k, v in counts.items()},
        "profiled_ms_per_step": profiled_ms,
        "time_by_op": time_by_op,
        "sampled": sampled,
        "dropped_options": dropped,
        "lora_stack_bytes": lora_stack_bytes(engine.model) if cfg["adapter_paths"] else 0,
        "read_gbps": gbps,
        "floor": floor,
    }


def run_worker(cfg: dict, shim: Path, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(shim), **THREAD_ENV)
    env.pop("PYTHONSTARTUP", None)
    cmd = [sys.executable, "-m", "benchmarks.step", "--worker", json.dumps(cfg)]
    # cwd: this repository, so `benchmarks.step` itself imports; it holds no `loraplex` folder
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    return {"error": f"exit {proc.returncode}: " + "\n".join(tail)}


# ---------------------------------------------------------------- report


@dataclass
class Tree:
    label: str  # "baseline" | "current"
    root: Path
    commit: str  # a commit id, or "working tree at <id>"
    shim: Path | None = None


def cpu_line() -> str:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{model}, {os.cpu_count()} logical CPUs, load average {load} (1 / 5 / 15 min)"


def ratio(new, old) -> float | None:
    return new / old if new is not None and old else None


def fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def rows_of(results: list[dict]) -> list[dict]:
    out = []
    for r in results:
        new, old = r.get("current", {}), r.get("baseline", {})
        row = {"batch": r["batch"], "adapters": r["adapters"]}
        for key in ("ms", "cpu_ms", "aten", "aten_no_view"):

            def get(res, key=key):
                if "error" in res or not res:
                    return None
                if key in ("ms", "cpu_ms"):
                    return res.get(f"{key}_per_step")
                return res["ops_per_step"][key]

            row[key] = (get(old), get(new), ratio(get(new), get(old)))
        out.append(row)
    return out


def table(results: list[dict]) -> str:
    head = (
        "| batch | adapters | wall ms/step baseline | current | ratio "
        "| CPU ms/step baseline | current | ratio | ops/step baseline | current | ratio "
        "| non-view ops baseline | current | ratio |"
    )
    lines = [head, "|" + "---:|" * 14]
    for row in rows_of(results):
        cells = [str(row["batch"]), str(row["adapters"])]
        specs = (("ms", ".1f"), ("cpu_ms", ".1f"), ("aten", ".0f"), ("aten_no_view", ".0f"))
        for key, spec in specs:
            old, new, rat = row[key]
            cells += [fmt(old, spec), fmt(new, spec), fmt(rat, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def model_line(report: dict) -> str:
    """The figure's title: which model, at what widths, in which dtype."""
    a = report["args"]
    model = a.get("model", "skinny")
    if model == "skinny":
        model = f"skinny {a['layers']}-layer Llama (8B layout, tiny widths)"
    else:
        model += f" ({a.get('dtype', 'float32')})"
    return f"{model}, one thread, rank-{a.get('rank', 16)} adapters on all seven projections"


def draw(results: list[dict], trees: list[dict], title: str, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no figure")
        return False
    rows = rows_of(results)
    labels = [f"b{r['batch']}\n{r['adapters']} ad." for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.4
    xs = range(len(rows))
    for ax, key, title in ((axes[0], "cpu_ms", "host CPU ms per decode step"),
                           (axes[1], "aten", "aten ops per decode step")):  # fmt: skip
        for j, tree in enumerate(trees):
            vals = [r[key][0 if tree["label"] == "baseline" else 1] for r in rows]
            vals = [float("nan") if v is None else v for v in vals]  # a failed run: no bar
            ax.bar([x + (j - (len(trees) - 1) / 2) * width for x in xs], vals, width,
                   label=f"{tree['label']} ({tree['commit']})")  # fmt: skip
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_doc(report: dict, results: list[dict], figure: Path | None, path: Path) -> None:
    a = report["args"]
    trees = ", ".join(f"{t['label']} {t['commit']}" for t in report["trees"])
    fig = f"\n![ms and ops per step]({figure.name})\n" if figure else ""
    roots = {}
    for r in results:
        for t in report["trees"]:
            res = r.get(t["label"], {})
            if "imported_from" in res:  # the engine package's folder, once per tree
                root = Path(res["imported_from"]).parent.parent
                roots[t["label"]] = ("this checkout" if root == REPO
                                     else f"a temporary folder `{root.name}`")  # fmt: skip
    imported = "; ".join(f"{k}: {v}" for k, v in roots.items()) or "nothing ran"
    same = ""
    if report.get("same_code"):
        same = (
            "**The two trees run the same step code** (between them no file of engine/ or "
            "kernels/ changed or went, only new ones came): the ratios below are the "
            "run-to-run spread on this machine, the floor under which a change cannot be told "
            "from noise.\n"
        )
    if a.get("model", "skinny") == "skinny":
        model = f"""on a model whose
arithmetic is negligible (a step's time is the ops' own cost, per call and in memory read,
and the host's work around them): Llama-3-8B's layout (32 layers, 32 query / 8 KV heads,
SwiGLU) at tiny widths (hidden 64, head_dim 8, FFN 128, vocab 512, {a.get("dtype", "float32")})"""
        target = """Issue 36 asks for ≤ 0.33 in time and ops at batch 64 with 32
  adapters."""
        layers = f" {a['layers']} layers,"
    else:
        m = report["model"]
        model = f"""on the peer comparisons' tiny Llama ({m.get("num_hidden_layers")} layers,
hidden {m.get("hidden_size")}, {m.get("num_attention_heads")} query /
{m.get("num_key_value_heads")} KV heads, FFN {m.get("intermediate_size")}, vocab
{m.get("vocab_size")}; `python -m benchmarks.peers`), {a.get("dtype", "float32")}, where the
products are most of a step"""
        target = "The floor below says how much of a step torch's kernels leave to the rest."
        layers = ""
    sampled = (
        f", then {a['sample_steps']} steps sampled by py-spy at {a['sample_rate']} Hz"
        if a.get("sample_steps")
        else ""
    )
    text = f"""# Host overhead per decode step (issue 36)

Host time and aten ops per decode step of the engine {model}. Every row decodes; row i uses
adapter i mod N of N PEFT LoRA adapters of rank {a.get("rank", 16)} on all seven projections
(N = 0: base rows, LoRA enabled with {SLOTS} slots). Each configuration and each source
tree ran in its own subprocess with **one compute thread**; the baseline tree is `git
archive` of its commit, imported as `loraplex` through a package of links placed first on the
subprocess's path (each subprocess reports the file it imported). Method and definitions:
the docstring of `benchmarks/step.py`.

Command: `{report["command"]}`

- Trees: {trees}
- CPU: {report["cpu"]}
- torch {report["torch"]}, Python {report["python"]}, {report["date"]}
- Per subprocess: prompts of {a["prompt_len"]} tokens prefilled, {a["warmup"]} warm-up decode
  steps, {a["repeats"]} rounds of {a["steps"]} timed `LLMEngine.step()` calls, then
  {a["profile_steps"]} steps under torch.profiler for the op counts{sampled};{layers}
  cpu_attention={a["cpu_attention"]}. Wall ms and CPU ms (the process's CPU time, which
  leaves out the time other processes held the core) are each the median of the rounds'
  medians; on a shared machine CPU ms is the steadier measure of host work.
- `loraplex.engine` imported from: {imported}
- ops/step: every aten op the profiler saw (nested ones included); non-view ops leave out ops
  whose schema returns an alias of an input (view, reshape, transpose, select, slice, ...).
- ratio: current / baseline. {target}

{same}
{table(results)}
{fig}
On a shared machine the milliseconds move by tens of per cent between runs (the load average
above says how busy it was); the op counts do not depend on load.
{time_section(results, report["trees"])}{floor_section(results)}{earlier_runs(report, path)}"""
    path.write_text(text)


def earlier_runs(report: dict, path: Path) -> str:
    """The other runs of the same question (the same model; another machine, attention form or
    tree) kept as results files: one page per question shows the latest run, these stay
    linked, and `--render` makes a page of any of them."""
    model = report["args"].get("model", "skinny")
    runs = []
    for file in sorted(RESULTS_JSON.parent.glob("step-*.json")):
        other = json.loads(file.read_text())
        if other.get("args", {}).get("model", "skinny") != model or other["date"] == report["date"]:
            continue
        current = other["trees"][-1]["commit"]
        cpu = other["cpu"].split(", load")[0]
        link = os.path.relpath(file, path.parent)
        attention = other["args"]["cpu_attention"]
        runs.append((other["date"], f"- [{file.name}]({link}): {cpu}, {other['date']}, "
                     f"tree {current}, cpu_attention={attention}"))  # fmt: skip
    if not runs:
        return ""
    lines = "\n".join(line for _, line in sorted(runs, reverse=True))
    return f"""
## Earlier runs

Runs of the same question on other machines, attention forms or trees, each in its results
file; `python -m benchmarks.step --render FILE --doc PAGE` writes a page like this one of any.

{lines}
"""


def time_section(results: list[dict], trees: list[dict]) -> str:
    """Per tree, at the largest configuration: the profiled step's time inside aten ops (the
    kernels and torch's dispatch) against the rest (the engine's Python), and the top ops."""
    if not results:
        return ""
    big = max(results, key=lambda r: (r["batch"], r["adapters"]))
    lines = [
        "",
        f"## Where a step's time goes (batch {big['batch']}, {big['adapters']} adapters)",
        "",
        "One profiled step (torch.profiler adds its own cost to every op, so these are shares, "
        "not the timings above): the self CPU time of aten ops (the kernels' arithmetic and "
        "copies and torch's dispatch inside them) and the rest of the step: the engine's "
        "Python between ops and much of the profiler's own cost per op, so the more ops a "
        "step has, the more this column overstates its Python (the sampled split below has "
        "no such cost).",
        "",
        "| tree | profiled ms/step | in aten ops | outside aten ops | top ops by self time, ms |",
        "|---|---:|---:|---:|---|",
    ]
    floor = ""
    for t in trees:
        res = big.get(t["label"], {})
        if res.get("lora_stack_bytes") and res.get("read_gbps") and not floor:
            mb, gbps = res["lora_stack_bytes"] / 1e6, res["read_gbps"]
            floor = (
                f"\nA floor under either tree's time at this configuration (both keep the "
                f"adapters in slot stacks): the slots' "
                f"A and B stacks are {mb:.0f} MB, which a step whose rows use every slot reads "
                f"at least once; this core reads {gbps:.1f} GB/s (torch.sum over 256 MB, one "
                f"thread), so that alone takes {mb / gbps:.1f} ms per step, before attention, "
                "the KV gathers and the base weights.\n"
            )
    for t in trees:
        res = big.get(t["label"], {})
        split = res.get("time_by_op")
        if not split:
            continue
        step_ms, aten = res["profiled_ms_per_step"], split["aten_ms"]
        top = ", ".join(f"{n.removeprefix('aten::')} {ms:.1f}" for n, ms in split["top"][:6])
        lines.append(f"| {t['label']} | {step_ms:.1f} | {aten:.1f} ({aten / step_ms:.0%}) | "
                     f"{step_ms - aten:.1f} ({1 - aten / step_ms:.0%}) | {top} |")  # fmt: skip
    return "\n".join(lines) + "\n" + sampled_section(big, trees) + floor


def sampled_section(big: dict, trees: list[dict]) -> str:
    """The same configuration sampled by py-spy: each tree's step split into time inside ATen
    ops ("kernels": their arithmetic and per-call C++), torch's dispatch and the engine's
    Python, in shares and in ms of the timed step."""
    got = [(t["label"], big.get(t["label"], {})) for t in trees]
    got = [(label, res) for label, res in got if (res.get("sampled") or {}).get("shares")]
    if not got:
        return ""
    lines = [
        "",
        "The same configuration sampled by py-spy (`--native`, "
        f"{got[0][1]['sampled']['rate']} Hz, the worker's own stacks, only samples inside "
        "`LLMEngine.step`), which costs nothing per op: a sample is inside an ATen op when "
        "ATen's CPU code (or MKL, oneDNN, SLEEF under it) is below its innermost Python frame: "
        "the op's arithmetic and its own per-call C++ (TensorIterator, the output's "
        "allocation); in torch's dispatch when other native code is (argument parsing, the "
        "dispatcher, tensor wrapping); else in the engine's Python. ms = share × the timed "
        "wall ms/step above. py-spy pauses the process for each sample and the code resumed "
        "after a pause runs colder, so the sampled steps run slower and a higher rate "
        "inflates the host's share (`--sample-rate`; the lowest rate that gives a few hundred "
        "samples is the truest).",
        "",
        "| tree | samples | inside ATen ops | torch's dispatch | Python |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, res in got:
        shares, ms = res["sampled"]["shares"], res["ms_per_step"]
        cells = " | ".join(f"{shares[k] * ms:.1f} ms ({shares[k]:.0%})" for k in SAMPLE_KINDS)
        lines.append(f"| {label} | {res['sampled']['samples']} | {cells} |")
    res = dict(got).get("current")
    base = (big.get("baseline") or {}).get("ms_per_step")
    if res and base:
        kernels = res["sampled"]["shares"]["kernels"] * res["ms_per_step"]
        lines += [
            "",
            f"The current tree's time inside ATen ops alone is about {kernels:.1f} ms of its "
            f"step, {kernels / base:.2f} of the baseline's whole step: "
            + (
                "more than a third, so with torch's CPU ops in these forms no host work, "
                "however small, brings the step to a third of the baseline's; only faster ops "
                "would."
                if kernels > base / 3
                else "under a third, so the rest of the step is what stands above it."
            ),
        ]
    return "\n".join(lines) + "\n"


def floor_section(results: list[dict]) -> str:
    """The kernel floor (`kernel_floor`) per configuration against both trees' steps."""
    rows = [r for r in results if (r.get("current") or {}).get("floor")]
    if not rows:
        return ""
    lines = [
        "",
        "## A floor under any step built from torch's CPU kernels",
        "",
        "`kernel_floor` in benchmarks/step.py, measured in the current tree's subprocess of "
        "each configuration (the same thread setting): per layer, attention's arithmetic on "
        "contiguous keys and values at the timed steps' middle context in the fastest of "
        "torch's forms (sdpa with the query heads of a kv head folded into rows, masked or "
        "not; two batched matmuls and a softmax) and the base model's four products; once a "
        "step the LM head; the adapters' A and B as PEFT stores them (no zeros between fused "
        "slices), read once at the core's bandwidth and not multiplied. Every kernel runs "
        "back to back with hot caches, and the norms, RoPE, SiLU, KV writes and gathers, "
        "sampling, the engine's Python and torch's dispatch count as free, so any step made "
        "of these kernels takes longer than this.",
        "",
        "| batch | adapters | context | attention ms/layer (form) | linears ms/layer "
        "| LM head ms | adapters read ms | floor ms/step | baseline wall ms | floor / baseline "
        "| current / floor |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fl = r["current"]["floor"]
        form, attn = min(fl["attention_ms_per_layer"].items(), key=lambda kv: kv[1])
        base = (r.get("baseline") or {}).get("ms_per_step")
        cur = r["current"].get("ms_per_step")
        lines.append(
            f"| {r['batch']} | {r['adapters']} | {fl['context']} | {attn:.3f} ({form}) "
            f"| {fl['linears_ms_per_layer']:.3f} | {fl['head_ms']:.3f} "
            f"| {fl['lora_read_ms']:.1f} | {fl['floor_ms']:.1f} | {fmt(base, '.1f')} "
            f"| {fmt(ratio(fl['floor_ms'], base), '.2f')} "
            f"| {fmt(ratio(cur, fl['floor_ms']), '.2f')} |"
        )
    big = max(rows, key=lambda r: (r["batch"], r["adapters"]))
    fl, base = big["current"]["floor"], (big.get("baseline") or {}).get("ms_per_step")
    if base:
        share = fl["floor_ms"] / base
        verdict = (
            "so these kernels leave room for a step a third as long as the baseline's: what "
            "stands between is the rest of the step (the floor's left-out work and the "
            "kernels' forms and layouts in the engine)"
            if share < 1 / 3
            else "so no step made of these kernels can take a third of the baseline's"
        )
        lines += [
            "",
            f"At batch {big['batch']} with {big['adapters']} adapters the floor is "
            f"{share:.2f} of the baseline's step, {verdict}.",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def model_config(folder: Path) -> dict:
    """The measured model's widths and depth, from its config.json."""
    config = json.loads((folder / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "num_hidden_layers")  # fmt: skip
    return {k: config[k] for k in keys if k in config}


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=DEFAULT_BASELINE,
                    help="commit to compare with (default: %(default)s)")  # fmt: skip
    ap.add_argument("--no-baseline", action="store_true", help="measure this checkout only")
    ap.add_argument("--current", metavar="REV",
                    help="measure this commit as 'current' instead of the working tree (a "
                         "baseline against its own successor shows the noise floor)")  # fmt: skip
    ap.add_argument("--batches", type=parse_ints, default=[1, 16, 64])
    ap.add_argument("--adapters", type=parse_ints, default=[0, 4, 32])
    ap.add_argument("--model", choices=MODELS, default="skinny",
                    help="the skinny 8B layout (default) or the peers' tiny Llama")  # fmt: skip
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32, help="the skinny model's layers")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per subprocess")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per round")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--sample-steps", type=int, default=150,
                    help="steps sampled by py-spy for the kernels / dispatch / Python split "
                         "(0: none)")  # fmt: skip
    ap.add_argument("--sample-rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--cpu-attention", default="sdpa",
                    help="EngineConfig.cpu_attention, the same for both trees (default "
                         "%(default)s: 'auto' times both forms at start and may pick "
                         "differently in the two subprocesses)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    ap.add_argument("--json", type=Path, default=RESULTS_JSON)
    ap.add_argument("--doc", type=Path, default=DOC, help="the page to write ('' for none)")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="only write --doc and its figure from a earlier run's JSON")  # fmt: skip
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    # SIGTERM as an exception: the temporary trees are removed and a running worker is killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.worker:
        print(RESULT_TAG + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if args.render:
        publish(json.loads(args.render.read_text()), args.doc)
        return

    import torch

    t0 = time.monotonic()
    model, adapter_paths = build_assets(args.layers, max(args.adapters), args.rank,
                                        model_name=args.model)  # fmt: skip
    head = resolve_commit("HEAD")
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                            *sorted(set(package_dirs(REPO).values()))],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    with contextlib.ExitStack() as stack:
        if args.current:  # a commit in place of the working tree
            commit = resolve_commit(args.current)
            trees = [Tree("current", stack.enter_context(source_tree(commit)), commit[:9])]
        else:
            edits = " + uncommitted edits" if dirty else ""
            trees = [Tree("current", REPO, head[:9] + edits)]
        if not args.no_baseline:
            commit = resolve_commit(args.baseline)
            root = stack.enter_context(source_tree(commit))
            trees.insert(0, Tree("baseline", root, commit[:9]))
        shims = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="step-shim-")))
        for tree in trees:
            tree.shim = make_shim(tree.root, shims / tree.label)
        same_code = None
        if not args.no_baseline:  # does the code a step runs differ at all?
            revs = [resolve_commit(args.baseline)] + (
                [resolve_commit(args.current)] if args.current else []
            )
            # added files alone change nothing until a changed file imports them
            diff = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "--diff-filter=a",
                                   *revs, "--", *STEP_DIRS], capture_output=True)  # fmt: skip
            untracked = subprocess.run(
                ["git", "-C", str(REPO), "status", "--porcelain", "--", *STEP_DIRS],
                capture_output=True,
                text=True,
            ).stdout
            same_code = diff.returncode == 0 and (bool(args.current) or not untracked.strip())
        names = ", ".join(f"{t.label} {t.commit}" for t in trees)
        print(f"one compute thread per subprocess; trees: {names}")
        results = []
        configs = [(b, n) for b in args.batches for n in args.adapters]
        for k, (batch, n) in enumerate(configs):
            entry = {"batch": batch, "adapters": n}
            order = trees if k % 2 == 0 else trees[::-1]  # alternate which tree runs first
            for tree in order:
                cfg = dict(root=str(tree.root), model=str(model), batch=batch, adapters=n,
                           adapter_paths=[str(p) for p in adapter_paths[:n]], rank=args.rank,
                           prompt_len=args.prompt_len, warmup=args.warmup,
                           repeats=args.repeats, steps=args.steps,
                           profile_steps=args.profile_steps, sample_steps=args.sample_steps,
                           sample_rate=args.sample_rate,
                           cpu_attention=args.cpu_attention, dtype=args.dtype,
                           floor=tree.label == "current")  # fmt: skip
                res = run_worker(cfg, tree.shim, args.timeout)
                res["load_before"] = os.getloadavg()[0]
                entry[tree.label] = res
                if "error" in res:
                    print(f"  b{batch:<3d} {n:2d} adapters {tree.label}: FAILED {res['error']}")
                else:
                    ops = res["ops_per_step"]
                    print(f"  b{batch:<3d} {n:2d} adapters {tree.label:8s} "
                          f"{res['ms_per_step']:7.1f} ms/step {res['cpu_ms_per_step']:7.1f} CPU ms "
                          f"{ops['aten']:8.0f} ops "
                          f"{ops['aten_no_view']:8.0f} non-view  "
                          f"({res['imported_from']})")  # fmt: skip
            results.append(entry)
    print()
    print(table(results))
    report = {
        "command": "python -m benchmarks.step " + " ".join(argv if argv is not None
                                                          else sys.argv[1:]),
        "cpu": cpu_line(), "torch": torch.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads_per_subprocess": 1, "same_code": same_code,
        "trees": [{"label": t.label, "commit": t.commit} for t in trees],
        "args": {k: v for k, v in vars(args).items()
                 if k not in ("json", "doc", "worker", "render")},
        "model": model_config(model), "targets": TARGETS,
        "results": results, "seconds": time.monotonic() - t0,
    }  # fmt: skip
    report["command"] = report["command"].strip()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.json}")
    if str(args.doc) not in ("", "."):
        publish(report, args.doc)
    print(f"{time.monotonic() - t0:.0f} s")


def publish(report: dict, doc: Path) -> None:
    """The page and its figure from a run's report (also `--render results.json`)."""
    figure = doc.with_suffix(".png")
    results = report["results"]
    drawn = draw(results, report["trees"], model_line(report), figure)
    write_doc(report, results, figure if drawn else None, doc)
    print(f"wrote {doc}" + (f" and {figure}" if drawn else ""))


if __name__ == "__main__":
    main()
