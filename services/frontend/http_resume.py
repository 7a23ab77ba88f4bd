"""Resuming an HTTP stream: a streamed chat or completion asked for with the `Vmesh-Resumable: 1`
header (or resumed) carries an SSE `id:` on its events with each choice's progress
(services/common/resume.py's event id); a client whose stream broke sends the same request again,
to any frontend, with the last id it received as the `Last-Event-ID` header, and gets exactly the
rest. Without the header no event has an id: SSE readers that take every event for a `data:`
line alone (vLLM's benchmark client among them) read vmesh's streams as they read vLLM's."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import replace

from vmesh.services.common.generation import GenerationOutput, GenerationRequest
from vmesh.services.common.resume import ResumePoint, new_resume_key, points_from_event_id
from vmesh.services.frontend.errors import Code, RequestError

HEADER = "last-event-id"
OPT_IN_HEADER = "vmesh-resumable"


def wants_event_ids(headers: Mapping[str, str]) -> bool:
    """Whether a request's stream carries event ids: asked for, or already being resumed."""
    return headers.get(OPT_IN_HEADER, "").strip().lower() in ("1", "true", "yes") or bool(headers.get(HEADER))


def resume_points(last_event_id: str | None, choices: list[GenerationRequest], stream: bool,
                  resumable: bool = True) -> tuple[list[ResumePoint], bool]:
    """Each choice's starting point, and whether this is a resume: from `last_event_id` (the
    header), else a new resume key per choice. `resumable`: the endpoint's streams carry event ids."""
    if not last_event_id:
        return [ResumePoint(new_resume_key()) for _ in choices], False
    if not (stream and resumable):
        raise RequestError(Code.INVALID_ARGUMENT, "Last-Event-ID resumes a streamed chat or completion only",
                           "Last-Event-ID")
    try:
        points = points_from_event_id(last_event_id)
    except ValueError as exc:
        raise RequestError(Code.INVALID_ARGUMENT, str(exc), "Last-Event-ID") from exc
    if len(points) != len(choices):
        raise RequestError(Code.INVALID_ARGUMENT, f"Last-Event-ID names {len(points)} choice(s); the request has "
                                                  f"{len(choices)}", "Last-Event-ID")
    return points, True


def resumed_request(request: GenerationRequest, point: ResumePoint, resuming: bool) -> GenerationRequest:
    return replace(request, resume_key=point.key, resume_from=point if resuming else None)


async def ended() -> AsyncGenerator[GenerationOutput, None]:
    """The stream of a choice whose end the client already has."""
    return
    yield  # pragma: no cover - makes this an async generator
