"""The server's errors: `APIError` in OpenAI's error shape, and `error_of`, the one mapping from any error to a
response."""

from __future__ import annotations

import re

from ..errors import GemmaAneError
from ..runtime.audio import AudioError
from ..runtime.images import ImageError


class APIError(GemmaAneError):
    """A request the server refuses, rendered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


PART = re.compile(r"messages\[\d+\]\.content\[\d+\]")


def error_of(exc: BaseException) -> APIError:
    """The one mapping from an error to a response: a package error by its class's `status`, `code` and
    `param` (gemma_ane.errors); any other ValueError is the request's (400), anything else the server's.
    A server error's message stays in the log: it may name the server's files."""
    if isinstance(exc, APIError):
        return exc
    status = exc.status if isinstance(exc, GemmaAneError) else 400 if isinstance(exc, ValueError) else 500
    code = exc.code if isinstance(exc, GemmaAneError) else None
    if status >= 500:
        return APIError(status, "the generation failed; see the server log", type="server_error", code=code)
    param = exc.param if isinstance(exc, GemmaAneError) else None
    if isinstance(exc, (ImageError, AudioError)):  # found by the runtime as it decodes: the message names the part
        part = PART.match(str(exc))
        param = part.group(0) if part else "messages"
    return APIError(status, str(exc), param=param, code=code)
