"""Alembic migrations of the loraplex registry, shipped as package data."""
