"""Upload intake and validation: every refusal, one test each, and the accepted shapes.

Each refusal must come with the right status and code, a message naming the problem (and not
our temp paths), and an empty temp root once the workspace closes.
"""

from __future__ import annotations

import asyncio
import io
import json
import struct
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.models.spec import spec_from_config
from loraplex.platform.store import CONFIG_FILE, WEIGHTS_FILE, adapter_digest
from loraplex.platform.uploads import (
    UploadError,
    areceive_files,
    check_base_model,
    receive_files,
    upload_workspace,
    validate_adapter,
)
from testkit.factories import HUGE_RANK, make_adapter, make_bad_adapters, make_tiny_model

MiB = 1024 * 1024
LIMIT = 4 * MiB
BASE_NAME = "tiny-llama"


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    root = tmp_path_factory.mktemp("uploads")
    base = make_tiny_model("llama", root / "base")
    good = make_adapter(base, root / "good", r=4, alpha=8, targets=("q_proj", "v_proj"))
    (good / "README.md").write_text("# model card peft writes\n")
    spec = spec_from_config(json.loads((base / "config.json").read_text()))
    return spec, good, make_bad_adapters(good, root / "bad"), root


@pytest.fixture
def tmp_root(tmp_path) -> Path:
    return tmp_path / "uploads-tmp"


def upload(parts, tmp_root, spec, *, max_bytes=LIMIT, max_rank=16):
    with upload_workspace(tmp_root) as ws:
        folder = receive_files(parts, ws, max_bytes)
        return validate_adapter(
            folder, spec, max_rank=max_rank, base_model_name=BASE_NAME, max_bytes=max_bytes
        )


def refused(parts, tmp_root, spec, status, code, *needles, **kw) -> UploadError:
    with pytest.raises(UploadError) as info:
        upload(parts, tmp_root, spec, **kw)
    err = info.value
    assert (err.status_code, err.code) == (status, code), err
    for needle in needles:
        assert needle in err.message, err
    assert str(tmp_root) not in err.message  # our temp paths are none of the client's business
    assert list(tmp_root.iterdir()) == []
    return err


def two_files(folder: Path) -> list[tuple[str, io.BytesIO]]:
    return [(n, io.BytesIO((folder / n).read_bytes())) for n in (CONFIG_FILE, WEIGHTS_FILE)]


def tar_gz(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def entry(name: str, data: bytes | None = b"", kind: bytes = tarfile.REGTYPE, link: str = ""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, data


def zip_of(files: dict[str, bytes]) -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    buf.seek(0)
    return buf


def with_header(folder: Path, out: Path, mutate) -> Path:
    """Copy of the adapter whose safetensors header went through `mutate(header) -> bytes`."""
    out.mkdir()
    (out / CONFIG_FILE).write_bytes((folder / CONFIG_FILE).read_bytes())
    raw = (folder / WEIGHTS_FILE).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = mutate(json.loads(raw[8 : 8 + n]))
    (out / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])
    return out


# --- accepted uploads ----------------------------------------------------------------------


def test_two_files(kit, tmp_root):
    spec, good, _, _ = kit
    info = upload(two_files(good), tmp_root, spec)
    assert (info.rank, info.alpha, info.targets) == (4, 8.0, ("q_proj", "v_proj"))
    assert info.digest == adapter_digest(good) and not info.use_rslora
    assert info.nbytes == sum((good / n).stat().st_size for n in (CONFIG_FILE, WEIGHTS_FILE))
    assert list(tmp_root.iterdir()) == []


@pytest.mark.parametrize("arcname", ["my-adapter", "."])  # a top folder, or `tar -C dir .`
def test_tar_gz_of_a_folder_with_its_readme(kit, tmp_root, arcname):
    spec, good, _, _ = kit
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(good, arcname=arcname)  # folder entry + both files + README.md
    buf.seek(0)
    assert upload([("my-adapter.tar.gz", buf)], tmp_root, spec).digest == adapter_digest(good)


def test_zip_with_files_at_root(kit, tmp_root):
    spec, good, _, _ = kit
    archive = zip_of({n: (good / n).read_bytes() for n in (CONFIG_FILE, WEIGHTS_FILE)})
    assert upload([("a.zip", archive)], tmp_root, spec).digest == adapter_digest(good)


def test_async_chunks(kit, tmp_root):
    spec, good, _, _ = kit

    async def chunks(data: bytes):
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    async def parts():
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            yield name, chunks((good / name).read_bytes())

    with upload_workspace(tmp_root) as ws:
        folder = asyncio.run(areceive_files(parts(), ws, LIMIT))
        assert adapter_digest(folder) == adapter_digest(good)
    assert list(tmp_root.iterdir()) == []


@pytest.mark.parametrize(
    "declared, ok",
    [
        (None, True),
        (BASE_NAME, True),
        ("meta-llama/Llama-3.2-1B", True),
        ("TinyLlama/TinyLlama-1.1B", True),
        ("/home/me/models/gemma-3-270m", True),  # absolute paths are the trainer's disk
        ("my-org/cool-model", True),  # names no family
        ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", True),
        ("google/gemma-3-270m", False),
        ("Qwen/Qwen2.5-0.5B", False),
        ("microsoft/phi-2", False),
        ("cognitivecomputations/dolphin-2.9", True),  # "phi" inside a word is no family
    ],
)
def test_base_model_rule(kit, declared, ok):
    spec = kit[0]
    if ok:
        check_base_model(declared, spec, BASE_NAME)
    else:
        with pytest.raises(UploadError, match="trained on") as info:
            check_base_model(declared, spec, BASE_NAME)
        assert info.value.code == "base_model_mismatch" and "llama" in info.value.message


# --- refused uploads: intake ---------------------------------------------------------------


def test_too_large_stops_reading_early(kit, tmp_root):
    pulled = 0

    def endless():
        nonlocal pulled
        while True:
            pulled += 1
            yield b"\0" * (64 * 1024)

    refused(
        [(WEIGHTS_FILE, endless())], tmp_root, kit[0], 413, "too_large", str(MiB), max_bytes=MiB
    )
    assert pulled == MiB // (64 * 1024) + 1


def test_unknown_file_name(kit, tmp_root):
    parts = [*two_files(kit[1]), ("notes.txt", io.BytesIO(b"hi"))]
    refused(parts, tmp_root, kit[0], 400, "unknown_file", "notes.txt")


def test_pickle_is_refused_unread(kit, tmp_root):
    class Unreadable(io.RawIOBase):
        def read(self, n=-1):
            raise AssertionError("a pickle upload must not be read")

    parts = [(CONFIG_FILE, io.BytesIO(b"{}")), ("adapter_model.bin", Unreadable())]
    refused(parts, tmp_root, kit[0], 400, "pickle_refused", "adapter_model.bin", "never loaded")


def test_receive_files_cleans_up_after_itself(kit, tmp_root):
    parts = [*two_files(kit[1]), ("notes.txt", io.BytesIO(b"hi"))]
    with pytest.raises(UploadError):
        receive_files(parts, tmp_root, LIMIT)  # no workspace around it
    assert list(tmp_root.iterdir()) == []


def test_missing_files(kit, tmp_root):
    parts = [(CONFIG_FILE, io.BytesIO((kit[1] / CONFIG_FILE).read_bytes()))]
    refused(parts, tmp_root, kit[0], 400, "missing_file", WEIGHTS_FILE)


# --- refused uploads: archives -------------------------------------------------------------


def test_archive_with_dotdot(kit, tmp_root):
    archive = tar_gz([entry("adapter/../../adapter_config.json", b"{}")])
    refused([("a.tar.gz", archive)], tmp_root, kit[0], 400, "unsafe_archive", "'..'")


def test_archive_with_absolute_path(kit, tmp_root):
    archive = tar_gz([entry("/etc/adapter_config.json", b"{}")])
    refused([("a.tgz", archive)], tmp_root, kit[0], 400, "unsafe_archive", "absolute path")


def test_archive_with_symlink(kit, tmp_root):
    archive = tar_gz([entry(WEIGHTS_FILE, None, tarfile.SYMTYPE, "/etc/passwd")])
    refused([("a.tar.gz", archive)], tmp_root, kit[0], 400, "unsafe_archive", "symbolic link")


def test_zip_with_symlink(kit, tmp_root):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo(WEIGHTS_FILE)
        info.create_system, info.external_attr = 3, 0o120777 << 16
        zf.writestr(info, "/etc/passwd")
    buf.seek(0)
    refused([("a.zip", buf)], tmp_root, kit[0], 400, "unsafe_archive", "symbolic link")


def test_archive_with_hardlink(kit, tmp_root):
    archive = tar_gz([entry(WEIGHTS_FILE, None, tarfile.LNKTYPE, "/etc/shadow")])
    refused([("a.tar.gz", archive)], tmp_root, kit[0], 400, "unsafe_archive", "hard link")


def test_zip_bomb(kit, tmp_root):
    archive = zip_of({CONFIG_FILE: b"{}", WEIGHTS_FILE: b"\0" * (16 * MiB)})
    assert len(archive.getvalue()) < 100_000
    refused([("a.zip", archive)], tmp_root, kit[0], 413, "too_large", "decompression bomb")


def test_zip_lying_about_its_size_is_caught(kit, tmp_root):
    """The central directory claims 1 KB; the data inflates to 4 MiB."""
    raw = bytearray(zip_of({WEIGHTS_FILE: b"\0" * (4 * MiB)}).getvalue())
    central = raw.rindex(b"PK\x01\x02")
    raw[central + 24 : central + 28] = struct.pack("<I", 1000)  # uncompressed size
    refused(
        [("a.zip", io.BytesIO(raw))], tmp_root, kit[0], 400, "bad_archive", "CRC", max_bytes=MiB
    )


def test_tar_bomb_in_a_pax_header(kit, tmp_root):
    """tarfile reads pax payloads into memory; the decompressed stream itself is capped."""
    info, data = entry(CONFIG_FILE, b"{}")
    info.pax_headers = {"comment": "x" * (8 * MiB)}
    archive = tar_gz([(info, data)])
    refused([("a.tgz", archive)], tmp_root, kit[0], 413, "too_large", "bomb", max_bytes=MiB)


def test_archive_with_too_many_entries(kit, tmp_root):
    archive = zip_of({f"adapter/f{i}.json": b"{}" for i in range(20)})
    refused([("a.zip", archive)], tmp_root, kit[0], 400, "too_many_entries", "more than")


def test_archive_holding_a_pickle(kit, tmp_root):
    archive = tar_gz([entry("adapter/adapter_config.json", b"{}"), entry("adapter/x.pt", b"x")])
    refused([("a.tar.gz", archive)], tmp_root, kit[0], 400, "pickle_refused", "x.pt")


def test_archive_with_extra_files_lists_them(kit, tmp_root):
    good = kit[1]
    files = {f"a/{n}": (good / n).read_bytes() for n in (CONFIG_FILE, WEIGHTS_FILE)}
    archive = zip_of({**files, "a/tokenizer.json": b"{}", "a/notes.txt": b""})
    refused([("a.zip", archive)], tmp_root, kit[0], 400, "unknown_file", "a/notes.txt, a/tokenizer")


def test_archive_with_two_top_folders(kit, tmp_root):
    archive = zip_of({f"x/{CONFIG_FILE}": b"{}", f"y/{WEIGHTS_FILE}": b""})
    refused([("a.zip", archive)], tmp_root, kit[0], 400, "bad_layout", "more than one place")


# --- refused uploads: adapter content ------------------------------------------------------


@pytest.mark.parametrize(
    "kind, status, code, needle",
    [
        ("truncated", 422, "bad_safetensors", "truncated"),
        ("nan", 422, "invalid_adapter", "NaN"),
        ("wrong_shape", 422, "invalid_adapter", "do not fit the base model"),
        ("unknown_target", 422, "invalid_adapter", "foo_proj"),
        ("config_unknown_target", 422, "invalid_adapter", "'not_a_module' does not exist"),
        ("undeclared_weights", 422, "invalid_adapter", "does not declare"),
        ("regex_targets", 422, "invalid_adapter", "regular expression"),
        ("huge_rank", 422, "rank_too_large", f"rank {HUGE_RANK} exceeds the maximum rank 16"),
        ("bad_json", 422, "bad_config", "adapter_config.json: not valid JSON"),
        ("missing_weights", 400, "missing_file", WEIGHTS_FILE),
    ],
)
def test_bad_adapter(kit, tmp_root, kind, status, code, needle):
    folder = kit[2][kind]
    parts = [(p.name, io.BytesIO(p.read_bytes())) for p in sorted(folder.iterdir())]
    refused(parts, tmp_root, kit[0], status, code, needle)


def test_bad_dtype(kit, tmp_root):
    spec, good, _, root = kit
    tensors = load_file(good / WEIGHTS_FILE)
    first = sorted(tensors)[0]
    tensors[first] = torch.zeros(tensors[first].shape, dtype=torch.int64)
    out = root / "i64"
    out.mkdir(exist_ok=True)
    (out / CONFIG_FILE).write_bytes((good / CONFIG_FILE).read_bytes())
    save_file(tensors, out / WEIGHTS_FILE)
    refused(two_files(out), tmp_root, spec, 422, "bad_dtype", "I64", first)


def _shift_first_end(h):
    first = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])[0]
    h[first]["data_offsets"][1] += 4
    return json.dumps(h).encode()


def _overlap(h):
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])
    h[names[1]]["data_offsets"] = [v - 4 for v in h[names[1]]["data_offsets"]]
    return json.dumps(h).encode()


def _duplicate(h):
    items = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in h.items()]
    return ("{" + ", ".join([*items, items[-1]]) + "}").encode()


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (_shift_first_end, "data_offsets"),
        (_overlap, "overlaps"),
        (_duplicate, "twice"),
        (lambda h: b"{not json", "not valid JSON"),
    ],
    ids=["offsets", "overlap", "duplicate", "not_json"],
)
def test_bad_safetensors_header(kit, tmp_root, tmp_path, mutate, needle):
    spec, good, _, _ = kit
    out = with_header(good, tmp_path / "adapter", mutate)
    refused(two_files(out), tmp_root, spec, 422, "bad_safetensors", needle)


def test_insane_header_length(kit, tmp_root, tmp_path):
    spec, good, _, _ = kit
    out = with_header(good, tmp_path / "adapter", lambda h: json.dumps(h).encode())
    raw = (out / WEIGHTS_FILE).read_bytes()
    (out / WEIGHTS_FILE).write_bytes(struct.pack("<Q", 2**40) + raw[8:])
    refused(two_files(out), tmp_root, spec, 422, "bad_safetensors", "not sane")


def test_base_model_mismatch(kit, tmp_root):
    spec, good, _, _ = kit
    cfg = json.loads((good / CONFIG_FILE).read_text())
    cfg["base_model_name_or_path"] = "google/gemma-3-270m"
    parts = [(CONFIG_FILE, io.BytesIO(json.dumps(cfg).encode())), two_files(good)[1]]
    refused(parts, tmp_root, spec, 422, "base_model_mismatch", "google/gemma-3-270m", "llama")


def test_regex_pattern_in_config_is_refused(kit, tmp_root):
    spec, good, _, _ = kit
    cfg = json.loads((good / CONFIG_FILE).read_text())
    cfg["rank_pattern"] = {"(.*)*q_proj": 4}
    parts = [(CONFIG_FILE, io.BytesIO(json.dumps(cfg).encode())), two_files(good)[1]]
    refused(parts, tmp_root, spec, 422, "bad_config", "rank_pattern")
