"""A reply that may not have arrived yet."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ReplyFuture(Generic[T]):
    __slots__ = ("_callbacks", "_error", "_event", "_value")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[ReplyFuture[T]], None]] = []

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> T:
        """The reply; raises the server's error at once, TimeoutError if none came in time."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"no reply within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the reply came within `timeout` seconds (it is never raised here)."""
        return self._event.wait(timeout)

    def exception(self) -> BaseException | None:
        return self._error if self._event.is_set() else None

    def add_done_callback(self, fn: Callable[[ReplyFuture[T]], None]) -> None:
        self._callbacks.append(fn)
        if self._event.is_set():
            fn(self)

    def set_result(self, value: T) -> None:
        self._value = value
        self._finish()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    def _finish(self) -> None:
        if self._event.is_set():
            return
        self._event.set()
        for fn in self._callbacks:
            fn(self)
