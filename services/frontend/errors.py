"""The frontend's one error type: a request it refuses or cannot finish, with the gRPC status
code that says why. Each shell turns it into its own transport's error (a gRPC status, or an
HTTP status with OpenAI's error body)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from vmesh.services.common.admission import InvalidRequest

Code = grpc.StatusCode


class RequestError(Exception):
    """`field`: the field to blame, as the gRPC API names it (None: no one field is)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    @classmethod
    def invalid(cls, exc: InvalidRequest) -> RequestError:
        return cls(Code.INVALID_ARGUMENT, str(exc), exc.field)


@contextmanager
def refused_as_request_errors() -> Iterator[None]:
    """An InvalidRequest raised inside becomes the RequestError the shells answer."""
    try:
        yield
    except InvalidRequest as exc:
        raise RequestError.invalid(exc) from exc
