"""What the unit tests that call a depot directly (the `depot` fixture, tests/unit/conftest.py)
speak as."""

from __future__ import annotations

from kvdepot.rpc.auth import ANONYMOUS, Caller

OWNER = Caller(b"\0conn", ANONYMOUS)
"""The caller these tests speak as: one connection, no tenant."""
