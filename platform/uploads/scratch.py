"""The server's upload scratch space (`<data_dir>/tmp`): where an upload is received, unpacked
and checked before it goes to the adapter store. Its failures are this server's disk, not the
store, and the answer says which: an operator frees disk space for the one and looks at the
store for the other."""

from __future__ import annotations

import errno
import logging

from loraplex.platform.errors import APIError

log = logging.getLogger("loraplex.platform")
_FULL = {errno.ENOSPC, errno.EDQUOT}


def scratch_unavailable(tenant_id: int | str, name: str, cause: OSError) -> APIError:
    """The 503 of an upload this server's scratch space could not take (a full disk, a folder
    gone or not writable). The cause names server folders: the log gets it, the client not."""
    log.warning("adapter %r of tenant %s: the upload scratch space failed: %s", name, tenant_id,
                cause)  # fmt: skip
    if cause.errno in _FULL:
        message, code = "this server's upload scratch space is full", "scratch_space_full"
    else:
        message, code = "this server's upload scratch space is unusable", "scratch_unavailable"
    return APIError(503, f"{message}; nothing was changed; retry later", code,
                    headers={"Retry-After": "30"})  # fmt: skip
