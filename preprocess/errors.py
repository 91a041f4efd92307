"""Errors about one media item. Each maps to an HTTP status and a stable machine-readable code.

A `MediaError` is always the client's problem (bad, unreachable, oversized or forbidden media); it fails
its own item and nothing else. Anything else raised while handling an item is a server fault (5xx).
"""

from __future__ import annotations


class MediaError(Exception):
    """One media item cannot be used. `status` is the HTTP status, `code` a stable error code."""

    status: int = 400
    code: str = "invalid_media"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.code


class FetchError(MediaError):
    """The media could not be downloaded or read (unreachable, HTTP error, timeout, bad data: URI)."""

    code = "fetch_failed"


class ForbiddenSource(MediaError):
    """The source is not allowed: scheme, private address, or a local path outside the allowed directory."""

    status = 403
    code = "forbidden_source"


class MediaTooLarge(MediaError):
    """Bytes, pixels or duration above a configured limit."""

    status = 413
    code = "media_too_large"


class DecodeError(MediaError):
    """The bytes are not a decodable image/video/audio (corrupt, truncated, unknown format)."""

    status = 415
    code = "undecodable_media"
