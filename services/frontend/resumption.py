"""A client resumes a broken stream here (its frontend died, or its connection broke): the
frontend finds the scheduler group that holds the request under its resume key, takes it over
(it stops there; the outputs the client has come back) and submits it again with them, as a
failover does (services/common/resume.py says why a resume recomputes rather than moves the
running request)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from vmesh.services.common.resume import ResumePoint
from vmesh.services.common.types import SamplingParams
from vmesh.services.detokenizer.incremental import IncrementalDetokenizer
from vmesh.services.frontend.errors import Code, RequestError
from vmesh.services.frontend.failover import Mesh

logger = logging.getLogger(__name__)

TAKE_OVER_TIMEOUT_S = 10.0
NOTHING_TO_RESUME = ("nothing to resume under this token: the stream was resumed already, or it ended too long "
                     "ago, or no scheduler that held it is reachable")


async def take_over(mesh: Mesh, resume: ResumePoint, prompt_digest: bytes) -> list[int]:
    """Ask every group for the request (resume keys are unique: at most one holds it); returns the
    first `resume.num_output_tokens` of its outputs. RequestError NOT_FOUND when no group holds
    it, INVALID_ARGUMENT (naming `resume`) when the resume does not fit it (another prompt, more
    tokens than it made)."""
    groups = [group for group in mesh.schedulers.members.active() if group.alive]
    answers = await asyncio.gather(*(group.take_over(resume, prompt_digest, TAKE_OVER_TIMEOUT_S) for group in groups),
                                   return_exceptions=True)
    for answer in answers:
        if isinstance(answer, list):
            return answer
    for answer in answers:
        if isinstance(answer, grpc.aio.AioRpcError) and answer.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise RequestError(Code.INVALID_ARGUMENT, answer.details() or "the resume does not fit its request",
                               "resume")
        if isinstance(answer, BaseException) and not (
                isinstance(answer, grpc.aio.AioRpcError) and answer.code() == grpc.StatusCode.NOT_FOUND):
            logger.warning("a take-over failed: %r", answer)
    raise RequestError(Code.NOT_FOUND, NOTHING_TO_RESUME)


def text_the_client_has(tokenizer: Any, params: SamplingParams, prompt: list[int], token_ids: list[int],
                        text_length: int) -> str:
    """The first `text_length` characters of the text of `token_ids`, decoded as the detokenizer
    decodes them (after the prompt's tail): what the client received of the resumed request."""
    if not token_ids:
        return ""
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, params, prompt)
    detokenizer.resume(token_ids, text_length)
    return detokenizer.text[:text_length]
