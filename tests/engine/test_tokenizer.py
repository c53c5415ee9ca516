import json
import random
from pathlib import Path

import pytest
import torch

from loraplex.engine.models.tokenizer import REPLACEMENT_CHAR, Tokenizer
from testkit.factories import (
    BAD_ADAPTER_KINDS,
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    HUGE_RANK,
    IM_END_ID,
    KINDS,
    make_adapter,
    make_bad_adapters,
    make_tiny_model,
    make_tokenizer,
)

MULTIBYTE = "héllo 日本語 🙂 naïve café — 👩‍💻 done"
ENGLISH = "The quick brown fox jumps over the lazy dog. Numbers 1, 42 and 2024!"


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tok_dir(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    make_tokenizer(path, byte_fallback=request.param == "byte_fallback")
    return path


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def stream(tok: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], str]:
    detok = tok.detokenizer(**kwargs)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas, detok.text


@pytest.mark.parametrize("text", [ENGLISH, MULTIBYTE, "", "  leading and trailing  \n\t"])
def test_encode_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_bos_added_only_with_special_tokens(tok):
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_token_id == BOS_ID
    assert tok.encode("hello", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_special_tokens_and_vocab(tok):
    assert tok.vocab_size == 512
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.eos_token_ids == {EOS_ID}


def test_eos_ids_are_union_of_all_files(tmp_path, tok_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END_ID}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {EOS_ID, IM_END_ID, 7, 8}


def test_model_folder_eos_from_generation_config(tiny_llama):
    assert Tokenizer.from_dir(tiny_llama).eos_token_ids == {EOS_ID, IM_END_ID}


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_renders_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"


def test_chat_template_matches_transformers(tok_dir, tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    messages = [{"role": "user", "content": "日本語 🙂 <b>&</b>"}]
    hf_text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == hf_text
    assert tok.encode(hf_text) == hf(hf_text).input_ids


def test_chat_template_raise_exception_becomes_value_error(tok):
    with pytest.raises(ValueError, match="unknown role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_chat_template_is_sandboxed(tok_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    cfg = {"chat_template": "{{ messages.append({'role': 'x'}) }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="chat template failed"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([])


@pytest.mark.parametrize("source", ["list", "jinja_file"])
def test_chat_template_other_sources(tok_dir, tmp_path, source):
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    cfg: dict = {"bos_token": "<s>", "eos_token": "</s>"}
    if source == "list":
        cfg["chat_template"] = [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": CHAT_TEMPLATE},
        ]
    else:
        (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    rendered = Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    assert rendered == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_missing_chat_template_raises(tok_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("text", [ENGLISH, MULTIBYTE, "🙂🙂🙂 日本語日本語"])
@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_matches_decode(tok, text, skip):
    ids = tok.encode(text, add_special_tokens=False)
    # Specials mid-stream (at a character boundary, else decode itself shows U+FFFD) and at the end.
    cut = next(k for k in range(3, len(ids)) if REPLACEMENT_CHAR not in tok.decode(ids[:k]))
    ids = ids[:cut] + [EOS_ID] + ids[cut:] + [IM_END_ID]
    deltas, text_so_far = stream(tok, ids, skip_special_tokens=skip)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == text_so_far == expected
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert deltas[-1] == ""  # nothing was held back at the end of valid text


def test_multibyte_chars_are_held_until_complete(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji really is split across byte tokens
    detok = tok.detokenizer()
    assert [detok.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]


def test_detokenizer_flushes_incomplete_tail(tok):
    ids = tok.encode("ok 🙂", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith(REPLACEMENT_CHAR)


def test_detokenizer_with_prompt_gives_the_continuation(tok):
    prompt = tok.encode("Once upon a time 日本")
    completion = tok.encode(" there was 語 🙂 a robot", add_special_tokens=False)
    deltas, _ = stream(tok, completion, prompt_ids=prompt)
    full = tok.decode(prompt + completion)
    assert "".join(deltas) == full[len(tok.decode(prompt)) :]


def test_detokenizer_random_valid_text_matches_decode(tok):
    rng = random.Random(0)
    words = ["the", " end", " ", "  ", "\n", "42", ",", "naïve"]
    pieces = [*words, "é", "日本", "語", "🙂", "👩\u200d💻"]
    for _ in range(50):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 30)):
            if rng.random() < 0.1:
                ids.append(rng.choice([EOS_ID, IM_END_ID]))
            else:
                ids += tok.encode(rng.choice(pieces), add_special_tokens=False)
        for skip in (True, False):
            detok = tok.detokenizer(skip_special_tokens=skip)
            deltas = [detok.push(i) for i in ids]
            assert detok.flush() == ""
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_detokenizer_random_ids_match_decode_byte_level(tmp_path):
    # Arbitrary ids, invalid UTF-8 included; exact for byte-level decoders only (see docstring).
    make_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        deltas, _ = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)


def test_detokenizer_cost_per_token_is_bounded(tok, monkeypatch):
    ids = tok.encode((MULTIBYTE + " " + ENGLISH) * 20, add_special_tokens=False)
    longest = 0
    real_decode = tok.decode

    def spy(window, skip_special_tokens=True):
        nonlocal longest
        longest = max(longest, len(window))
        return real_decode(window, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    deltas, _ = stream(tok, ids)
    monkeypatch.undo()
    assert "".join(deltas) == tok.decode(ids)
    assert len(ids) > 500 and longest <= 8


# --- factories: what other tests build on ---


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_model_and_adapter_load_in_transformers(kind, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = make_tiny_model(kind, tmp_path / "base", shard=True)
    assert (base_dir / "model.safetensors.index.json").is_file()
    assert len(list(base_dir.glob("model-*.safetensors"))) > 1
    ids = Tokenizer.from_dir(base_dir).encode(ENGLISH)[:24]  # > gemma3's window of 8

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    logits = _logits(base, ids)
    assert logits.shape == (len(ids), 512)
    assert logits.std() > 0.2  # not flat: argmax differs between models and adapters

    adapter_dir = make_adapter(base_dir, tmp_path / "adapter")
    assert {p.name for p in adapter_dir.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    fresh = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = PeftModel.from_pretrained(fresh, adapter_dir).eval()
    assert (_logits(lora, ids) - logits).abs().max() > 0.1


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    from safetensors.torch import load_file

    a = load_file(make_tiny_model("qwen2", tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_tiny_model("qwen2", tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_model("qwen2", tmp_path / "c", seed=4) / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.bias"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
    assert a[name].abs().min() > 0  # qwen2 biases are random, not zero


def test_bad_adapters(tiny_llama, tmp_path):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    good = make_adapter(tiny_llama, tmp_path / "good", r=4)
    bad = make_bad_adapters(good, tmp_path / "bad")
    assert set(bad) == set(BAD_ADAPTER_KINDS)
    assert not (bad["pickle_only"] / "adapter_model.safetensors").exists()
    assert not (bad["missing_config"] / "adapter_config.json").exists()
    assert not (bad["missing_weights"] / "adapter_model.safetensors").exists()
    with pytest.raises(json.JSONDecodeError):
        json.loads((bad["bad_json"] / "adapter_config.json").read_text())
    with pytest.raises(SafetensorError):
        load_file(bad["truncated"] / "adapter_model.safetensors")

    def weights(name: str) -> dict[str, torch.Tensor]:
        return load_file(bad[name] / "adapter_model.safetensors")

    assert any(t.isnan().any() for t in weights("nan").values())
    assert any(t.isinf().any() for t in weights("inf").values())
    assert any("foo_proj" in k for k in weights("unknown_target"))
    good_shapes = {k: v.shape for k, v in load_file(good / "adapter_model.safetensors").items()}
    changed = [k for k, v in weights("wrong_shape").items() if v.shape != good_shapes[k]]
    assert len(changed) == 1 and "lora_A" in changed[0]
    cfg = json.loads((bad["huge_rank"] / "adapter_config.json").read_text())
    assert cfg["r"] == HUGE_RANK
    assert all(HUGE_RANK in v.shape for v in weights("huge_rank").values())


def with_special_marker(src: Path, dst: Path, marker: str = "[TOOL_CALLS]") -> int:
    """A copy of a model or tokenizer folder whose last BPE merge's token becomes `marker`, a
    special token (as Mistral's tokenizers mark their tool-call marker), the vocabulary keeping
    its size so the model still fits."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    spec = json.loads((dst / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    last = max(vocab, key=vocab.get)  # made by the last merge, which nothing builds on
    spec["model"]["merges"].pop()
    marker_id = vocab.pop(last)
    vocab[marker] = marker_id
    spec["added_tokens"].append(dict(id=marker_id, content=marker, single_word=False,
                                     lstrip=False, rstrip=False, normalized=False,
                                     special=True))  # fmt: skip
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return marker_id


def test_kept_special_tokens_stay_in_the_text_and_no_others(tok_dir, tmp_path):
    marker_id = with_special_marker(tok_dir, tmp_path / "tok")
    tok = Tokenizer.from_dir(tmp_path / "tok")
    assert marker_id in tok.special_token_ids
    call = tok.encode(' [{"name": "f", "arguments": {}}]', add_special_tokens=False)
    ids = tok.encode("Sure.", add_special_tokens=False) + [marker_id, *call, EOS_ID]
    _, dropped = stream(tok, ids)
    assert dropped == tok.decode(ids) and "[TOOL_CALLS]" not in dropped
    deltas, kept = stream(tok, ids, kept=["[TOOL_CALLS]", "<not a token>"])
    assert "".join(deltas) == kept
    assert kept == tok.decode(ids[:-1], skip_special_tokens=False)  # </s> still dropped
    assert kept.startswith("Sure.") and "[TOOL_CALLS]" in kept and kept.endswith("}]")
    # A prompt that ends in the marker: the continuation is the text after it.
    deltas, _ = stream(tok, call, prompt_ids=[BOS_ID, marker_id], kept=["[TOOL_CALLS]"])
    both = tok.decode([marker_id, *call], skip_special_tokens=False)
    assert "".join(deltas) == both[len("[TOOL_CALLS]") :]
