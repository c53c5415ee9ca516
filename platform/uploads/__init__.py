"""Adapter upload intake and validation, independent of the web framework.

Accepted uploads:

- exactly the two PEFT files, `adapter_config.json` + `adapter_model.safetensors`, or
- one `.tar.gz` / `.tgz` / `.zip` holding them at its root or inside one top folder.

`README.md` (peft's `save_pretrained` writes one) is tolerated and dropped. Any other file is
refused with its name listed, so nothing is ignored silently; pickle files (`.bin`, `.pt`,
`.pth`, `.pkl`, `.pickle`, `.ckpt`) are refused unread. Archives may not hold links, devices,
absolute or `..` paths, nested folders, more than a few entries, or expand past the limit.

Every refusal is an `UploadError(status_code, code, message)`: 413 `too_large`; 400 for a
malformed upload (`unknown_file`, `pickle_refused`, `missing_file`, `duplicate_file`,
`bad_file_name`, `mixed_upload`, `bad_archive`, `unsafe_archive`, `too_many_entries`,
`bad_layout`); 422 for an adapter that cannot be served (`bad_config`, `bad_safetensors`,
`bad_dtype`, `rank_too_large`, `base_model_mismatch`, `invalid_adapter`).

    with upload_workspace(settings.tmp_dir) as ws:
        folder = receive_files(parts, ws, max_bytes=quota.max_adapter_bytes)
        info = validate_adapter(folder, spec, max_rank=..., base_model_name=..., max_bytes=...)
        key = store.put(folder, info.digest)
"""

from loraplex.platform.uploads.archive import extract_archive
from loraplex.platform.uploads.intake import areceive_files, receive_files, upload_workspace
from loraplex.platform.uploads.policy import MAX_ARCHIVE_ENTRIES, TOLERATED_FILES, UploadError
from loraplex.platform.uploads.validate import (
    ValidatedAdapter,
    check_base_model,
    read_safetensors_header,
    validate_adapter,
)

__all__ = [
    "MAX_ARCHIVE_ENTRIES",
    "TOLERATED_FILES",
    "UploadError",
    "ValidatedAdapter",
    "areceive_files",
    "check_base_model",
    "extract_archive",
    "read_safetensors_header",
    "receive_files",
    "upload_workspace",
    "validate_adapter",
]
