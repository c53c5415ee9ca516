"""--kv-cache-dtype and --kv-admission reach the engine config from `serve` (via settings)
and `generate`."""

from __future__ import annotations

import pytest

from loraplex.platform import cli
from loraplex.platform.main import engine_config


def test_serve_flag_reaches_engine_config(tiny_models):
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--kv-cache-dtype", "int8", "--max-model-len", "256"])
    settings = cli._settings(args)
    assert settings.kv_cache_dtype == "int8"
    assert engine_config(settings, str(tiny_models["llama"])).kv_cache_dtype == "int8"
    default = cli._settings(parser.parse_args(["serve", "--max-model-len", "256"]))
    assert engine_config(default, str(tiny_models["llama"])).kv_cache_dtype == "auto"
    assert not engine_config(default, str(tiny_models["llama"])).kv_admission
    adm = cli._settings(parser.parse_args(["serve", "--kv-admission", "--max-model-len", "256"]))
    assert engine_config(adm, str(tiny_models["llama"])).kv_admission
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "fp8"])


def test_generate_with_int8_kv_cache(tiny_models, capsys):
    argv = ["generate", "hello", "--model", str(tiny_models["llama"]), "--dtype", "float32",
            "--max-tokens", "4", "--max-model-len", "64", "--kv-cache-dtype", "int8",
            "--kv-admission"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "4 tokens" in capsys.readouterr().err


def test_generate_takes_its_device_as_serve_does(tiny_models, capsys, monkeypatch):
    """`generate` runs where `serve` would (`--device auto`: the GPU torch sees, else the CPU)
    and refuses a device this torch cannot use before loading anything."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["generate", "hello", "--model", str(tiny_models["llama"]), "--dtype", "float32",
            "--max-tokens", "2", "--max-model-len", "64"]  # fmt: skip
    assert cli.main(argv) == 0 and "2 tokens" in capsys.readouterr().err
    assert cli.main([*argv, "--device", "cuda"]) == 2  # one line, no traceback
    assert "loraplex: error: device 'cuda': " in capsys.readouterr().err
