"""The tests' S3 server: `testkit/moto_server.py` (the fleet benchmark starts the same)."""

from testkit.moto_server import ACCESS_KEY, REGION, SECRET_KEY, free_port, moto_server

__all__ = ["ACCESS_KEY", "REGION", "SECRET_KEY", "free_port", "moto_server"]
