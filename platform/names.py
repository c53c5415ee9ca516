"""What an adapter's name may be: one definition for the routes, the service and the schemas.

Names travel in URLs and in the OpenAI `model` field, so no slashes, spaces, leading dots or
control characters. Checked with a full match everywhere: Python's `re` lets `$` match before a
trailing newline, pydantic's (Rust) regex does not, and the two disagreeing once let
`"evil\\n"` past the route into a schema that refused it as a 500.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
ADAPTER_NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
_ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN.removeprefix("^").removesuffix("$"))

AdapterName = Annotated[str, Field(pattern=ADAPTER_NAME_PATTERN, max_length=64)]


def is_adapter_name(value: object) -> bool:
    return isinstance(value, str) and _ADAPTER_NAME.fullmatch(value) is not None
