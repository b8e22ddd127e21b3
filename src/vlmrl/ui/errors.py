"""The one exception the web app turns into a client answer: every module of `vlmrl ui` raises it,
and the app renders it as `{"error": message, ...extra}` with its HTTP status."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An answer for the page: HTTP status, a message naming the field or file, extra keys."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra
