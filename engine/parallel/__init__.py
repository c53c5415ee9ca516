"""Tensor parallelism: one base model across several processes (docs/tensor-parallel.md)."""
