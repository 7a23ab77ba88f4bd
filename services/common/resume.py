"""Resuming a stream through another frontend: the client's handle on a request (its resume
key, drawn once and kept across failovers and frontends), how far the client got (a
`ResumePoint`), the digest a take-over checks the prompt against, and the kept outputs a
scheduler group holds for a grace period after a request ends (`EndedRequests`), from which
the frontend the client comes back to takes the tokens the client has.

A resume submits the request again with those tokens, as every other failover does: the
prefix cache holds the blocks of its prompt and outputs, so it costs a mostly cached prefill,
and the client receives exactly the text and tokens it lacks. Protobuf-free."""

from __future__ import annotations

import hashlib
import secrets
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# How long a group keeps what a request made after it ended (its frontend or client gone, or
# finished), for its client to resume; and how many such requests, and tokens in all, it keeps.
RESUME_GRACE_S = 60.0
MAX_ENDED_REQUESTS = 4096
MAX_ENDED_TOKENS = 4 * 1024 * 1024  # 16 MiB of token ids


def new_resume_key() -> str:
    """128 random bits: knowing a key is the right to take its request over."""
    return secrets.token_urlsafe(16)


def prompt_digest(prompt_token_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("I", prompt_token_ids).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class ResumePoint:
    """How far a client got in one stream: its resume key, the output token ids and the
    characters of text it received, and whether it saw the stream's end (then nothing is resumed)."""
    key: str
    num_output_tokens: int = 0
    text_length: int = 0
    finished: bool = False


class NothingToResume(Exception):
    """The group holds nothing under the key (never did, or no longer)."""


class ResumeRefused(Exception):
    """The client's resume does not fit the request it names."""


@dataclass
class _Ended:
    prompt_digest: bytes
    output_token_ids: array
    expires_at: float


class EndedRequests:
    """What requests with a resume key made, kept for `grace_s` after they ended, at most
    `max_requests` of them and `max_tokens` tokens in all (the oldest go first)."""

    def __init__(self, grace_s: float = RESUME_GRACE_S, max_requests: int = MAX_ENDED_REQUESTS,
                 max_tokens: int = MAX_ENDED_TOKENS, clock: Callable[[], float] = time.monotonic):
        self.grace_s = grace_s
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.clock = clock
        self._ended: OrderedDict[str, _Ended] = OrderedDict()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._ended)

    def keep(self, resume_key: str, digest: bytes, output_token_ids: Sequence[int]) -> None:
        self._drop(resume_key)
        tokens = array("I", output_token_ids)
        self._ended[resume_key] = _Ended(digest, tokens, self.clock() + self.grace_s)
        self.num_tokens += len(tokens)
        self._expire()

    def take(self, resume_key: str, digest: bytes, num_output_tokens: int) -> list[int]:
        """The first `num_output_tokens` outputs of the request kept under `resume_key`, which is
        forgotten (a stream is resumed once)."""
        self._expire()
        ended = self._ended.get(resume_key)
        if ended is None:
            raise NothingToResume(resume_key)
        check_resume(ended.prompt_digest, digest, len(ended.output_token_ids), num_output_tokens)
        self._drop(resume_key)
        return ended.output_token_ids[:num_output_tokens].tolist()

    def _drop(self, resume_key: str) -> None:
        if (ended := self._ended.pop(resume_key, None)) is not None:
            self.num_tokens -= len(ended.output_token_ids)

    def _expire(self) -> None:
        now = self.clock()
        while self._ended:
            key, oldest = next(iter(self._ended.items()))
            if oldest.expires_at > now and len(self._ended) <= self.max_requests \
                    and self.num_tokens <= self.max_tokens:
                return
            self._drop(key)


def check_resume(kept_digest: bytes, digest: bytes, num_made: int, num_claimed: int) -> None:
    """A resume fits its request: the same prompt, and no more output tokens than it made."""
    if kept_digest != digest:
        raise ResumeRefused("the resumed request's prompt differs from the original's")
    if num_claimed > num_made:
        raise ResumeRefused(f"the client claims {num_claimed} output tokens; the request made {num_made}")


# An HTTP stream's event id (Server-Sent Events' `id:` field, which a client sends back as the
# Last-Event-ID header): each choice's progress, "KEY.TOKENS.CHARS", with ".f" when the client has
# its end, comma-separated in choice order. Keys are URL-safe base64, so neither separator occurs.
def event_id(points: Sequence[ResumePoint]) -> str:
    return ",".join(progress_entry(p.key, p.num_output_tokens, p.text_length, p.finished) for p in points)


def progress_entry(key: str, num_output_tokens: int, text_length: int, finished: bool) -> str:
    """One choice's entry of an event id (written for every streamed event: no ResumePoint built)."""
    return f"{key}.{num_output_tokens}.{text_length}.f" if finished else f"{key}.{num_output_tokens}.{text_length}"


def points_from_event_id(text: str) -> list[ResumePoint]:
    """The progress an event id holds; ValueError for text that is not one."""
    points = []
    for entry in text.strip().split(","):
        key, tokens, chars, *end = entry.split(".")
        if not key or end not in ([], ["f"]) or not (tokens.isdigit() and chars.isdigit()):
            raise ValueError(f"not a vmesh event id: {entry!r}")
        points.append(ResumePoint(key, int(tokens), int(chars), finished=bool(end)))
    return points
