"""API key secrets: generation, hashing, comparison.

Keys are 32 random bytes (256 bits), so they are stored as a plain SHA-256 of the secret.
Slow, salted hashes (bcrypt, argon2) exist to protect low-entropy human passwords against
guessing; nobody can guess a 256-bit random value, and a fast hash lets every request be
authenticated with one indexed lookup instead of a hash made slow on purpose, paid on every
request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "lpx_"
ADMIN_KEY_PREFIX = "lpxadmin_"
DISPLAY_PREFIX_CHARS = 12  # "lpx_" + 8 chars: enough to tell keys apart in a listing
_KEY_BYTES = 32

_PLACEHOLDER_WORDS = ("changethis", "changeme", "placeholder", "example", "replaceme", "default")


def hash_key(secret: str) -> str:
    """The hex SHA-256 of a key secret, as stored in the registry."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_api_key() -> tuple[str, str, str]:
    """A fresh tenant key: (secret shown once, display prefix, hash to store)."""
    secret = KEY_PREFIX + secrets.token_urlsafe(_KEY_BYTES)
    return secret, secret[:DISPLAY_PREFIX_CHARS], hash_key(secret)


def new_admin_key() -> str:
    """A fresh admin key, for dev mode's generated one and for operators to copy."""
    return ADMIN_KEY_PREFIX + secrets.token_urlsafe(_KEY_BYTES)


def constant_time_equals(a: str, b: str) -> bool:
    """Compare secrets without leaking the length of the common prefix through timing."""
    return hmac.compare_digest(a.encode(), b.encode())


def looks_like_placeholder(value: str) -> bool:
    """True for secrets nobody generated randomly: template words, or very few distinct chars."""
    lowered = value.lower().replace("-", "").replace("_", "")
    return any(word in lowered for word in _PLACEHOLDER_WORDS) or len(set(value)) < 8
