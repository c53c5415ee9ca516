"""The one switch between Triton kernels (CUDA) and the torch reference (everything else).

Engine code calls ops only through this module. Until the Triton kernels land, every device
uses the reference.
"""

from __future__ import annotations

from loraplex.kernels import reference

write_kv_cache = reference.write_kv_cache
paged_attention = reference.paged_attention
lora_apply = reference.lora_apply
