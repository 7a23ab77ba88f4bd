"""The one loop over a step's outputs: each request's incremental detokenizer, stop strings,
output mode and logprobs, and which requests a stop string ended (so that whoever runs the
scheduler core aborts them there). The detokenizer service and the in-process engine both
run their steps' tokens through it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic

from opentelemetry import trace
from tokenizers import Tokenizer

from vmesh.services.common.types import (
    FinishReason,
    Handle,
    RequestRef,
    SamplingParams,
    StepTokens,
    TokenLogprobs,
)
from vmesh.services.detokenizer.incremental import IncrementalDetokenizer


@dataclass
class RequestState:
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    num_output_tokens: int = 0  # resumed ones included
    ref: RequestRef | None = None  # the owning frontend's (the detokenizer service's requests)
    span: trace.Span = trace.INVALID_SPAN  # the request's life here, ended when it finishes


@dataclass
class ProcessedOutput(Generic[Handle]):
    handle: Handle
    state: RequestState
    text: str  # per the request's output mode
    token_ids: list[int]
    finish_reason: FinishReason | None  # a stop string's STOP when the request did not end upstream
    finished: bool
    num_cached_prompt_tokens: int
    logprobs: list[TokenLogprobs]
    error: str
    prompt_logprobs: list[TokenLogprobs]  # with the first tokens of a request that asked
    embedding: list[float]  # with an embedding request's first token


class OutputProcessor(Generic[Handle]):
    """Per-request output state, by the handle the tokens arrive under."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[Handle, RequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Handle]:
        return iter(self.requests)

    def add_request(self, handle: Handle, params: SamplingParams, prompt_token_ids: Sequence[int],
                    num_prompt_tokens: int, resumed_output_token_ids: Sequence[int] = (),
                    resumed_text_length: int = 0, ref: RequestRef | None = None,
                    span: trace.Span = trace.INVALID_SPAN) -> RequestState:
        """`prompt_token_ids`: the prompt, or at least its last PROMPT_TAIL_TOKENS, as decoding context.
        A resumed request continues the text the client has (its first `resumed_text_length` characters)."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, params, list(prompt_token_ids))
        if resumed_output_token_ids:
            detokenizer.resume(list(resumed_output_token_ids), resumed_text_length)
        state = self.requests[handle] = RequestState(detokenizer, num_prompt_tokens, len(resumed_output_token_ids),
                                                     ref, span)
        return state

    def items(self) -> Iterable[tuple[Handle, RequestState]]:
        return self.requests.items()

    def pop(self, handle: Handle) -> RequestState | None:
        """Forget a request (aborted, or its reader went away)."""
        return self.requests.pop(handle, None)

    def process(self, batch: Iterable[StepTokens[Handle]]) -> tuple[list[ProcessedOutput[Handle]], list[Handle]]:
        """Decode one step's tokens. Returns the outputs worth sending (new text or tokens, or an
        end) and the requests a stop string finished, which the scheduler core must abort."""
        outputs: list[ProcessedOutput[Handle]] = []
        stopped: list[Handle] = []
        for tokens in batch:
            handle = tokens.handle
            state = self.requests.get(handle)
            if state is None:
                continue  # already finished here (e.g. by a stop string) or let go
            state.num_output_tokens += len(tokens.token_ids)
            result = state.detokenizer.update(tokens.token_ids, tokens.finished)
            reason = tokens.finish_reason
            if result.stop_hit and not tokens.finished:
                reason = FinishReason.STOP
                stopped.append(handle)
            if result.finished:
                del self.requests[handle]
                state.span.set_attribute("vmesh.output_tokens", state.num_output_tokens)
                state.span.end()
            if not result.text and not tokens.token_ids and not result.finished:
                continue
            outputs.append(ProcessedOutput(handle, state, result.text, tokens.token_ids, reason, result.finished,
                                           tokens.num_cached_prompt_tokens, tokens.logprobs, tokens.error,
                                           tokens.prompt_logprobs, tokens.embedding))
        return outputs, stopped
