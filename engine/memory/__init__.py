"""Where KV lives: the block pool, the cache tensors, swap to host memory, the memory budget."""
