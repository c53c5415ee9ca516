"""Find a table row by its Name cell, not by text anywhere in the row.

A key's row also shows its random prefix (``lpx_Md3m_MUZ…``), and Playwright's ``has_text``
matches a substring, case-insensitively: a key named ``ci`` was once found in another key's
row whose prefix held ``Ci``.
"""

from __future__ import annotations

import re


def named_row(page, name: str, rows: str = "tr"):
    """The rows matching ``rows`` whose Name cell is ``name`` (a "this session" badge allowed)."""
    exact = re.compile(rf"^\s*{re.escape(name)}\s*(this session)?\s*$")
    return page.locator(rows, has=page.locator("td[data-label=Name]", has_text=exact))
