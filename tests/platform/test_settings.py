"""Settings: embedded defaults, environment and config file, production secret checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from loraplex.platform.security import new_admin_key
from loraplex.platform.settings import Settings

GOOD_KEY = new_admin_key()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_defaults_live_under_the_data_dir(tmp_path):
    s = Settings()
    data = tmp_path / "home" / ".cache" / "loraplex"
    assert s.data_dir == data
    assert s.database_url == f"sqlite:///{data}/loraplex.db"
    assert s.store_url == data.joinpath("adapters").as_uri()
    assert s.local_store_dir == data / "adapters" and s.s3_location is None
    assert s.adapter_cache_dir == data / "adapter-cache"
    assert (s.model, s.dtype, s.quantization, s.max_loras, s.max_lora_rank) == (
        "demo", "auto", None, 8, 64,
    )  # fmt: skip
    assert (s.host, s.port, s.dev_mode, s.admin_key) == ("127.0.0.1", 8000, True, None)
    assert s.max_upload_bytes == 512 * 1024 * 1024


def test_environment_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("LORAPLEX_MAX_LORAS", "4")
    monkeypatch.setenv("LORAPLEX_QUANTIZATION", "int4")
    monkeypatch.setenv("LORAPLEX_LOG_JSON", "true")
    s = Settings()
    assert s.database_url == f"sqlite:///{tmp_path}/d/loraplex.db"
    assert (s.max_loras, s.quantization, s.log_json) == (4, "int4", True)


@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_postgres_urls_use_psycopg3(monkeypatch, scheme):
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", f"{scheme}://u:pw@db:5432/lpx")
    assert Settings().database_url == "postgresql+psycopg://u:pw@db:5432/lpx"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("database_url", "mysql://db/x", "use sqlite:///path/to.db or postgresql://"),
        ("store_url", "s3://", "names no bucket"),
        ("store_url", "http://host/x", "file:///path/to/dir"),
        ("max_loras", 0, "max_loras"),
        ("dtype", "int8", "dtype"),
        ("aws_access_key_id", "AKIA", "set both aws_access_key_id and aws_secret_access_key"),
    ],
)
def test_bad_values_say_what_to_change(field, value, message):
    with pytest.raises(ValidationError, match=message):
        Settings(**{field: value})


def test_store_urls(tmp_path):
    s3 = Settings(store_url="s3://bucket/some/prefix/", s3_endpoint_url="http://127.0.0.1:9000")
    assert s3.s3_location == ("bucket", "some/prefix") and s3.local_store_dir is None
    assert Settings(store_url=str(tmp_path / "st")).local_store_dir == tmp_path / "st"


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_config_file_below_environment(monkeypatch, tmp_path, suffix):
    config = tmp_path / f"loraplex{suffix}"
    values = {"max_num_seqs": 16, "port": 9000, "data_dir": str(tmp_path / "cfg")}
    if suffix == ".json":
        config.write_text(json.dumps(values))
    else:
        config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    monkeypatch.setenv("LORAPLEX_CONFIG", str(config))
    monkeypatch.setenv("LORAPLEX_PORT", "9100")
    s = Settings()
    assert (s.max_num_seqs, s.port, s.data_dir) == (16, 9100, tmp_path / "cfg")


def test_config_file_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAPLEX_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ValueError, match="no such file"):
        Settings()
    typo = tmp_path / "typo.toml"
    typo.write_text("max_lora = 4\n")  # not max_loras
    monkeypatch.setenv("LORAPLEX_CONFIG", str(typo))
    with pytest.raises(ValidationError, match="max_lora"):
        Settings()


def test_outside_dev_mode_an_admin_key_is_required():
    with pytest.raises(ValidationError, match="LORAPLEX_ADMIN_KEY") as e:
        Settings(dev_mode=False)
    assert "at least 32 characters" in str(e.value)
    with pytest.raises(ValidationError, match="admin_key has 12 characters"):
        Settings(dev_mode=False, admin_key="short-secret")
    with pytest.raises(ValidationError, match="admin_key looks like a placeholder"):
        Settings(dev_mode=False, admin_key="changethis-changethis-changethis-1")
    with pytest.raises(ValidationError, match="admin_key looks like a placeholder"):
        Settings(dev_mode=False, admin_key="a" * 40)
    with pytest.raises(ValidationError, match="password in database_url"):
        Settings(dev_mode=False, admin_key=GOOD_KEY, database_url="postgresql://u:changethis@h/d")

    s = Settings(dev_mode=False, admin_key=GOOD_KEY)
    assert s.admin_key.get_secret_value() == GOOD_KEY
    assert GOOD_KEY not in repr(s)  # secrets stay out of logs


def test_dev_mode_allows_no_admin_key(monkeypatch):
    monkeypatch.setenv("LORAPLEX_DEV_MODE", "true")
    assert Settings().admin_key is None
    assert isinstance(Settings().data_dir, Path)


def test_engine_settings_and_flags_derive_from_the_engine_options(tiny_models):
    """One definition per engine option (engine/options.py): the server's setting has the
    engine's type, default (or the server's own), bounds and help; the flag of `serve` sets
    it; the engine config built from the settings carries it."""
    from loraplex.engine.options import server_options
    from loraplex.platform.cli import build_parser
    from loraplex.platform.main import engine_config

    options = server_options()
    assert {o.setting for o in options} >= {"swap_space_gib", "max_loras", "engine_threads"}
    for o in options:
        field = Settings.model_fields[o.setting]
        assert (field.description, field.default) == (o.help, o.default), o.name
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Settings(num_speculative_tokens=17)  # the engine's bound, on the setting
    argv = ["serve", "--swap-space", "1.5", "--kv-cache-dtype", "int8", "--max-loras", "3",
            "--max-model-len", "256"]  # fmt: skip
    args = build_parser().parse_args(argv)
    from loraplex.platform import cli

    settings = cli._settings(args)
    config = engine_config(settings, str(tiny_models["llama"]))
    assert (config.swap_space_gib, config.kv_cache_dtype, config.max_loras) == (1.5, "int8", 3)
    assert config.max_model_len == 256
    assert config.scheduling_policy == "vtc" and Settings().max_model_len == 2048  # the server's
    with pytest.raises(SystemExit):  # choices come from the option's Literal type
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int3"])


def test_the_operations_page_lists_every_engine_setting():
    from loraplex.engine.options import server_options

    page = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    for o in server_options():
        row = f"| `{o.setting.upper()}` | {f'`{o.flag}`' if o.flag else ''} | `{o.default}` |"
        assert row in page, f"docs/operations.md: the row of {o.setting} is missing or stale"


def test_the_server_picks_its_device(tiny_models, monkeypatch):
    """`serve` runs its engine on the GPU torch sees (`--device auto`, the server's default;
    the library's stays cpu), on the one named, or refuses at start a device this torch cannot
    use, saying what to pass; `--enforce-eager` reaches the engine as vLLM's flag does."""
    import torch

    from loraplex.engine import LLMEngine
    from loraplex.engine.options import EngineOptions
    from loraplex.platform import cli
    from loraplex.platform.main import engine_config

    model = str(tiny_models["llama"])

    def config(*argv: str):
        argv = ["serve", "--max-model-len", "64", *argv]  # the tiny model's context is 512
        return engine_config(cli._settings(cli.build_parser().parse_args(argv)), model)

    assert Settings().device == "auto" and EngineOptions().device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert config().device == "cpu"  # auto, no GPU
    with pytest.raises(ValueError, match=r"device 'cuda': .* sees no GPU here; pass device cpu"):
        config("--device", "cuda")
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N, got 'mps'"):
        config("--device", "mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert config().device == "cuda"  # auto, with GPUs
    assert config("--device", "cuda:1").device == "cuda:1"
    assert config("--device", "cpu").device == "cpu"
    monkeypatch.setenv("LORAPLEX_DEVICE", "cuda:2")  # the environment, as the Helm chart sets it
    with pytest.raises(ValueError, match=r"torch sees 2 GPU\(s\), cuda:0\.\.1"):
        config()
    monkeypatch.delenv("LORAPLEX_DEVICE")
    assert config().enforce_eager is None  # graphs where the engine is on CUDA
    assert config("--enforce-eager").enforce_eager is True
    assert config("--no-enforce-eager").enforce_eager is False
    monkeypatch.setenv("LORAPLEX_ENFORCE_EAGER", "true")
    assert config().enforce_eager is True
    # the GPU's share for the KV pool, as vLLM's flag (the library leaves kv_cache_bytes)
    assert EngineOptions().gpu_memory_utilization is None
    assert config().gpu_memory_utilization == 0.9
    assert config("--gpu-memory-utilization", "0.5").gpu_memory_utilization == 0.5
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        config("--gpu-memory-utilization", "1.5")
    # With no GPU, a server left on auto builds a working engine on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LORAPLEX_ENFORCE_EAGER")
    engine = LLMEngine(config())
    assert engine.model.device.type == "cpu" and engine.runner.graphs is None
