"""What an upload may contain, and the one error type every refusal uses."""

from __future__ import annotations

from loraplex.platform.store.base import ADAPTER_FILES

# peft's save_pretrained writes a model card beside the adapter; refusing it would refuse
# most archives of a saved folder. It is dropped, never stored or read.
TOLERATED_FILES = ("README.md",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip")
# Top folder + two adapter files + README, with room for `./` entries some tar tools add.
MAX_ARCHIVE_ENTRIES = 8
CHUNK = 1024 * 1024


class UploadError(Exception):
    """An upload we refuse. `status_code` is the HTTP status, `code` a stable machine name."""

    def __init__(self, status_code: int, code: str, message: str):
        super().__init__(message)
        self.status_code, self.code, self.message = status_code, code, message

    def __repr__(self) -> str:
        return f"UploadError({self.status_code}, {self.code!r}, {self.message!r})"


def too_large(what: str, limit: int) -> UploadError:
    return UploadError(413, "too_large", f"{what} exceeds the limit of {limit} bytes")


def expected_files() -> str:
    return f"{' and '.join(ADAPTER_FILES)} (or one {'/'.join(ARCHIVE_SUFFIXES)} archive of them)"


def refuse_pickles(names: list[str]) -> None:
    pickles = [n for n in names if n.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise UploadError(
            400,
            "pickle_refused",
            f"{', '.join(pickles)}: pickle files are never loaded (unpickling runs arbitrary "
            "code); save the adapter as safetensors (peft's save_pretrained does by default)",
        )


def is_archive(name: str) -> bool:
    return name.lower().endswith(ARCHIVE_SUFFIXES)


def is_wanted(name: str) -> bool:
    """An adapter file we keep (True) or a tolerated one we drop (False); others raise."""
    if name in ADAPTER_FILES:
        return True
    if name in TOLERATED_FILES:
        return False
    raise unknown_files([name])


def unknown_files(names: list[str]) -> UploadError:
    return UploadError(
        400,
        "unknown_file",
        f"unexpected file(s): {', '.join(sorted(names))}; an upload holds only "
        f"{expected_files()}; {', '.join(TOLERATED_FILES)} is allowed and ignored",
    )
