"""Our token ids against transformers' `AutoTokenizer`, for each supported family's tokenizer
layout: clients that tokenize on their side (lm-eval, guidellm) must get the ids the server
uses.

The engine reads `tokenizer.json` as written (engine/models/tokenizer.py). The folders here are
written the way each family's published checkpoints are (tokenizer.json + tokenizer_config.json
with the family's `tokenizer_class`, config.json with its `model_type`), on a tiny BPE trained
here; the demo's is the real Gemma 3 one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import processors as tp
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from loraplex.engine.models.tokenizer import Tokenizer as OurTokenizer

# Llama 3's and Qwen2's split patterns, as their tokenizer.json files carry them.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and they'll say we're fine.",
    "Numbers: 1, 12, 123, 1234, 3.14159, 2024-12-06 and 1e10; code: def f(x): return x**2",
    "Unicode: héllo naïve café, 日本語のテキスト, Ελληνικά, русский, emoji 🙂👩‍💻",
    "Whitespace:  two   three\t\ttabs\n\nnew lines    trailing  ",
] * 20
TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "runs of    spaces\t\t\ttabs\n\n\nand newlines \r\n windows",
    "      ",
    "digits 0 7 42 123 4567 89012 3.14159 -17 1e-9 1,000,000",
    "héllo naïve café résumé — “quotes” ‘single’ …",
    "日本語のテキスト 中文 한국어 Ελληνικά русский العربية",
    "emoji 🙂 👩‍💻 🇫🇷 and combining e\u0301 a\u0308",
    "I'm sure THEY'RE here, you'll see; it's JSON: {\"a\": [1, 2]}",
    "def f(x):\n    return x ** 2  # squared\n",
]


def _save(tok: Tokenizer, path: Path, family: dict) -> Path:
    """A folder as the family's checkpoints ship it, written by transformers' save_pretrained."""
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **family["special"])
    fast.save_pretrained(str(path))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = family["class"]
    config.update(family.get("config", {}))
    config_path.write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"model_type": family["model_type"]}))
    return path


def _byte_level(split: str, specials: list[str], bos: str | None, nfc: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if bos is None:
        tok.post_processor = tp.ByteLevel(trim_offsets=False)
    else:
        tok.post_processor = tp.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )  # fmt: skip
    return tok


def _sentencepiece(specials: list[str], metaspace: bool = False) -> Tokenizer:
    """Mistral's converted SentencePiece: "▁" for spaces, byte fallback; v0.1 files spell the
    spaces with a normalizer, v0.3 ones with a Metaspace pre-tokenizer."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Metaspace("▁", prepend_scheme="first",
                                         split=False), decoders.ByteFallback()])  # fmt: skip
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])  # fmt: skip
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials + bytes_,
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = tp.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


FAMILIES = {
    "llama3": {
        "build": lambda: _byte_level(LLAMA3_SPLIT, ["<|begin_of_text|>", "<|end_of_text|>",
                                                    "<|eot_id|>"], "<|begin_of_text|>", False),
        "special": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        "class": "PreTrainedTokenizerFast",
        "model_type": "llama",
    },
    "mistral": {
        "build": lambda: _sentencepiece(["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]),
        "special": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "class": "LlamaTokenizer",
        "config": {"add_bos_token": True, "add_eos_token": False, "legacy": False},
        "model_type": "mistral",
    },
    "mistral-v0.3": {
        "build": lambda: _sentencepiece(["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], True),
        "special": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "class": "LlamaTokenizer",
        "config": {"add_bos_token": True, "add_eos_token": False, "legacy": False},
        "model_type": "mistral",
    },
    "qwen2": {
        "build": lambda: _byte_level(QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                     None, True),
        "special": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "class": "Qwen2Tokenizer",
        "config": {"bos_token": None, "add_prefix_space": False},
        "model_type": "qwen2",
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=[*FAMILIES, "gemma3-demo"])
def folder(request, tmp_path_factory) -> Path:
    if request.param == "gemma3-demo":
        return request.getfixturevalue("demo_model_dir")
    family = FAMILIES[request.param]
    return _save(family["build"](), tmp_path_factory.mktemp(request.param), family)


def _texts(ours: OurTokenizer) -> list[str]:
    specials = [ours.decode([i], skip_special_tokens=False) for i in sorted(ours.special_token_ids)]
    return [*TEXTS, f"{specials[0]}text between {specials[-1]} special tokens", *specials[:3]]


def test_text_prompts_tokenize_as_auto_tokenizer(folder):
    ours = OurTokenizer.from_dir(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    for text in _texts(ours):
        for special in (True, False):
            expected = theirs(text, add_special_tokens=special)["input_ids"]
            got = ours.encode(text, add_special_tokens=special)
            assert got == expected, (folder.name, text, special)


def test_a_tokenizer_json_unlike_its_class_is_read_as_written(tmp_path):
    """transformers 5 rebuilds some classes' pipeline from the class (Qwen2Tokenizer: its own
    split pattern, one digit per piece) whatever tokenizer.json says; the server reads
    tokenizer.json as written. Published Qwen2 files agree with the class (above); a folder
    whose tokenizer.json differs is tokenized by its file, as docs/openai-compat.md states."""
    family = FAMILIES["qwen2"]
    tok = _byte_level(LLAMA3_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, True)
    folder = _save(tok, tmp_path, family)
    text = "digits 1234567"
    as_written = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    assert OurTokenizer.from_dir(folder).encode(text) == as_written
    assert AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"] != as_written
