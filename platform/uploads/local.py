"""An adapter folder on the server's own disk, named by an operator (vLLM's `lora_path`).

Only folders inside the configured import roots can be read, never an arbitrary server path:

- a relative path is looked up under each root in turn; an absolute one must lie in a root;
- a `..` component is refused outright, before anything touches the disk;
- every link is resolved, and the real location of the folder and of each file in it must
  still lie inside a root (a Hugging Face cache's snapshot links into its own blobs pass; a
  link to /etc does not);
- only regular files are opened (never a FIFO or a device), without following a link.

The files then go through the same intake and validation as an upload (`receive_files`,
`validate_adapter`): names, pickle refusal, size limit, PEFT checks.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path, PurePosixPath

from loraplex.platform.uploads.policy import UploadError


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _refuse(message: str) -> UploadError:
    return UploadError(400, "path_not_allowed", message)


def resolve_import_folder(lora_path: str, roots: list[Path]) -> Path:
    """The real folder `lora_path` names inside one of `roots` (absolute, resolved paths).

    UploadError 400 `path_not_allowed` for a path outside every root (`..`, an absolute path
    elsewhere, a link out); 404 `lora_path_not_found` when no root holds such a folder.
    """
    if not lora_path or "\x00" in lora_path or "\\" in lora_path:
        raise _refuse("lora_path must be a non-empty POSIX path")
    path = PurePosixPath(lora_path)
    if ".." in path.parts:
        raise _refuse("lora_path may not contain '..'")
    candidates = [Path(path)] if path.is_absolute() else [root / path for root in roots]
    for candidate in candidates:
        if not _inside(candidate, roots):
            raise _refuse("lora_path must lie inside an adapter import root")
        real = Path(os.path.realpath(candidate))
        if not _inside(real, roots):
            raise _refuse("lora_path leads outside the adapter import roots (a link)")
        try:
            if real.is_dir():
                return real
        except OSError:  # a name longer than the filesystem allows: no such folder
            continue
    raise UploadError(
        404, "lora_path_not_found", f"no adapter folder {lora_path!r} in the import roots"
    )


@contextmanager
def folder_parts(folder: Path, roots: list[Path]) -> Iterator[list[tuple[str, object]]]:
    """(name, open binary file) of each entry of `folder`, for `receive_files`; closed after.

    A subfolder, a special file or a link out of the roots is refused (400) unread.
    """
    with ExitStack() as stack:
        parts = []
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            real = Path(os.path.realpath(entry.path))
            if not _inside(real, roots):
                raise _refuse(f"{entry.name} links outside the adapter import roots")
            if not stat.S_ISREG(os.stat(real).st_mode):
                raise UploadError(
                    400, "unknown_file", f"{entry.name} is not a regular file; a PEFT folder "
                    "holds adapter_config.json and adapter_model.safetensors only"
                )  # fmt: skip
            # O_NONBLOCK: a file swapped for a FIFO since the check cannot hang the open.
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            f = stack.enter_context(os.fdopen(fd, "rb"))
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UploadError(400, "unknown_file", f"{entry.name} is not a regular file")
            parts.append((entry.name, f))
        yield parts
