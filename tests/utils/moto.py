"""The tests' S3 server: `benchmarks/moto_server.py` (the fleet benchmark starts the same)."""

from benchmarks.moto_server import ACCESS_KEY, REGION, SECRET_KEY, free_port, moto_server

__all__ = ["ACCESS_KEY", "REGION", "SECRET_KEY", "free_port", "moto_server"]
