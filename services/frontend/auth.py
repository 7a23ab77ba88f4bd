"""The API key a frontend may require of its callers, checked the same way by both shells."""

from __future__ import annotations

import hashlib
import hmac

from vmesh.services.frontend.errors import Code, RequestError


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """`authorization`: the `Authorization` header (HTTP) or `authorization` metadata (gRPC)."""
    if not expected:
        return
    scheme, _, token = (authorization or "").partition(" ")
    # Digests of equal length: the time taken says nothing of the key, not even its length.
    given = hashlib.sha256(token.strip().encode()).digest()
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, hashlib.sha256(expected.encode()).digest()):
        raise RequestError(Code.UNAUTHENTICATED, "missing or invalid API key (expected 'Authorization: Bearer KEY')")
