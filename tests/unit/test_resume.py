"""Resuming a stream: the outputs a scheduler group keeps after a resumable request ends, the
take-over that hands them to the frontend a client comes back to, and the HTTP event ids."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.factories import make_scheduler
from vmesh.services.common.resume import (
    EndedRequests,
    NothingToResume,
    ResumePoint,
    ResumeRefused,
    event_id,
    new_resume_key,
    points_from_event_id,
    prompt_digest,
)
from vmesh.services.common.types import FinishReason, SamplingParams
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.session import SchedulerSession
from vmesh.services.scheduler.settings import SchedulerServiceSettings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


DIGEST = prompt_digest([1, 2, 3])


def test_a_kept_request_is_taken_once_with_the_tokens_the_client_has():
    ended = EndedRequests()
    ended.keep("k", DIGEST, [7, 8, 9, 10])
    assert ended.take("k", DIGEST, 3) == [7, 8, 9]
    with pytest.raises(NothingToResume):
        ended.take("k", DIGEST, 3)
    assert ended.num_tokens == 0


def test_a_take_with_another_prompt_or_more_tokens_than_made_is_refused_and_keeps_the_request():
    ended = EndedRequests()
    ended.keep("k", DIGEST, [7, 8])
    with pytest.raises(ResumeRefused, match="prompt differs"):
        ended.take("k", prompt_digest([1, 2, 4]), 1)
    with pytest.raises(ResumeRefused, match="claims 3 output tokens; the request made 2"):
        ended.take("k", DIGEST, 3)
    assert ended.take("k", DIGEST, 2) == [7, 8]


def test_kept_requests_expire_after_the_grace_period():
    clock = Clock()
    ended = EndedRequests(grace_s=60, clock=clock)
    ended.keep("old", DIGEST, [1])
    clock.now = 30
    ended.keep("new", DIGEST, [2])
    clock.now = 61
    with pytest.raises(NothingToResume):
        ended.take("old", DIGEST, 0)
    assert ended.take("new", DIGEST, 1) == [2]


def test_the_oldest_go_first_past_the_count_and_token_bounds():
    ended = EndedRequests(max_requests=2, max_tokens=5)
    ended.keep("a", DIGEST, [1])
    ended.keep("b", DIGEST, [1])
    ended.keep("c", DIGEST, [1])  # past two requests: a goes
    assert len(ended) == 2
    ended.keep("d", DIGEST, [1, 2, 3, 4, 5])  # past five tokens: b and c go
    assert len(ended) == 1 and ended.num_tokens == 5
    for gone in "abc":
        with pytest.raises(NothingToResume):
            ended.take(gone, DIGEST, 0)


def test_event_ids_round_trip_and_refuse_what_is_not_one():
    points = [ResumePoint(new_resume_key(), 12, 40), ResumePoint(new_resume_key(), 3, 9, finished=True)]
    assert points_from_event_id(event_id(points)) == points
    for bad in ["", "key", "key.1", "key.1.x", "key.1.2.g", ".1.2", "key.-1.2"]:
        with pytest.raises(ValueError):
            points_from_event_id(bad)


# --- the scheduler session's take-over -------------------------------------------------------


def session_with_core() -> SchedulerSession:
    """A session whose core exists (as once its workers answered), without streams."""
    settings = SchedulerServiceSettings(worker_addresses=["127.0.0.1:1"], detokenizer_addresses=["127.0.0.1:2"])
    session = SchedulerSession(settings)
    session.use_core(make_scheduler(num_blocks=64))
    return session


def resumable(key: str, outputs: list[int]) -> Request:
    return Request(f"frontend-a/{key}", [1, 2, 3], SamplingParams(max_tokens=16), output_token_ids=list(outputs),
                   resume_key=key, prompt_digest=DIGEST)


def test_a_running_request_is_stopped_and_handed_over():
    session = session_with_core()
    core = session.core()
    request = resumable("k", [5, 6, 7])
    core.add_request(request)
    session.add_resumable(request)
    assert asyncio.run(session.take_over("k", DIGEST, 2)) == [5, 6]
    assert request.finish_reason is FinishReason.ABORT and not core.requests and "k" not in session.resumable
    with pytest.raises(NothingToResume):  # resumed once
        asyncio.run(session.take_over("k", DIGEST, 2))


def test_a_running_request_with_another_prompt_keeps_running():
    session = session_with_core()
    request = resumable("k", [5])
    session.core().add_request(request)
    session.add_resumable(request)
    with pytest.raises(ResumeRefused):
        asyncio.run(session.take_over("k", prompt_digest([9]), 1))
    assert not request.is_finished


def test_a_request_that_ended_whatever_ended_it_is_kept_for_its_client():
    session = session_with_core()
    core = session.core()
    for key, reason in (("aborted", FinishReason.ABORT), ("stopped", FinishReason.STOP)):
        request = resumable(key, [4, 5])
        core.add_request(request)
        session.add_resumable(request)
        core.abort(request.request_id, reason)
    assert asyncio.run(session.take_over("aborted", DIGEST, 1)) == [4]
    assert asyncio.run(session.take_over("stopped", DIGEST, 2)) == [4, 5]


def test_an_earlier_submission_ending_leaves_a_later_one_resumable():
    """A failover resubmits under the same resume key: the old one's end must not unlist the new."""
    session = session_with_core()
    core = session.core()
    old, new = resumable("k", [1]), Request("frontend-a/new", [1, 2, 3], SamplingParams(max_tokens=16),
                                            output_token_ids=[1, 2], resume_key="k", prompt_digest=DIGEST)
    for request in (old, new):
        core.add_request(request)
        session.add_resumable(request)
    core.abort(old.request_id)
    assert session.resumable["k"] == new.request_id
    assert asyncio.run(session.take_over("k", DIGEST, 2)) == [1, 2]
    assert new.is_finished


def test_a_request_without_a_resume_key_is_not_kept():
    session = session_with_core()
    request = Request("frontend-a/1", [1, 2, 3], SamplingParams(max_tokens=16))
    session.core().add_request(request)
    session.add_resumable(request)
    session.core().abort(request.request_id)
    assert len(session.ended) == 0 and not session.resumable
