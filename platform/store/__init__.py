"""Adapter storage: a content-addressed store (local folder or S3) and a local disk cache."""

from loraplex.platform.store.base import (
    ADAPTER_FILES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterNotFound,
    AdapterStore,
    StoreError,
    adapter_digest,
)
from loraplex.platform.store.cache import AdapterCache, CacheStats
from loraplex.platform.store.factory import make_store
from loraplex.platform.store.local import LocalStore

__all__ = [
    "ADAPTER_FILES",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "AdapterCache",
    "AdapterNotFound",
    "AdapterStore",
    "CacheStats",
    "LocalStore",
    "StoreError",
    "adapter_digest",
    "make_store",
]
