"""The core types every service holds a request's settings and news in, and the defaults they
carry, each written once. Nothing here knows protobuf: services/common/wire/ translates these
to and from the messages of each link."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

# Below this a temperature means greedy; dividing by it would overflow the logits.
GREEDY_TEMPERATURE_EPS = 1e-5
# max_tokens when a request leaves it unset (common.proto); the frontend fills in the context's room instead.
DEFAULT_MAX_TOKENS = 16
# The most top-N alternatives a request may ask logprobs for (OpenAI's top_logprobs limit too).
MAX_LOGPROBS = 20
# Prompt tokens given to the detokenizer as decoding context, so the first output token decodes
# as it would mid-text (some tokenizers drop a leading space at the start of a text).
PROMPT_TAIL_TOKENS = 4
# The roles a vmesh process plays; a TLS identity's common name is one of them.
SERVICE_ROLES = ("frontend", "scheduler", "worker", "detokenizer")
ROLES = (*SERVICE_ROLES, "admin")  # admin: operator tools, not a service
# What a structured-output request may ask its output to match (StructuredOutput.kind).
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
# The libraries that compile and enforce them; StructuredOutput.backend is one of these or "auto".
GRAMMAR_BACKENDS = ("xgrammar", "llguidance")


class OutputMode(Enum):
    """How a request's text is sent back; the values are the names clients and flags use."""
    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


class FinishReason(Enum):
    """Why a request ended; the values are the names metrics, traces and OpenAI's API use."""
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


def finish_name(reason: FinishReason | None) -> str:
    """The reason's name ("" while the request runs), as metrics and traces label it."""
    return reason.value if reason else ""


@dataclass(frozen=True)
class StructuredOutput:
    """What a request asks its output to match, as the client wrote it (before compiling)."""
    kind: str  # one of STRUCTURED_KINDS
    # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON array of strings;
    # grammar: EBNF (GBNF) or Lark text; structural_tag: its JSON; json_object: "" (any JSON object)
    source: str = ""
    backend: str = "auto"  # "auto" or one of GRAMMAR_BACKENDS: what the client asked for


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled once by the frontend, carried with the request to the worker."""
    backend: str  # the backend that compiled it (one of GRAMMAR_BACKENDS)
    key: str  # hex sha256 over backend, kind, source and the tokenizer's identity: the cache key
    payload: bytes  # xgrammar: its CompiledGrammar.serialize_json() (utf-8); llguidance: its grammar JSON


class PoolingType(Enum):
    """How an embedding request's final hidden states become one vector; the values are vLLM's names."""
    LAST = "LAST"  # the last prompt position's
    MEAN = "MEAN"  # the mean over every prompt position
    CLS = "CLS"  # the first prompt position's


@dataclass(frozen=True)
class Pooling:
    """An embedding request's pooling: its type and whether the vector is scaled to unit L2 norm."""
    type: PoolingType = PoolingType.LAST
    normalize: bool = True

    @property
    def reads_prefix_cache(self) -> bool:
        """LAST only: the last prompt position is always computed (the scheduler never serves it
        from the cache), while MEAN and CLS need positions a cached block would skip."""
        return self.type is PoolingType.LAST


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: off; N >= 0: sampled token's logprob plus the top N
    # None: off; N >= 0: each prompt token's logprob (from the second on) plus the top N, computed at prefill
    prompt_logprobs: int | None = None
    output_mode: OutputMode = OutputMode.DELTA
    structured: StructuredOutput | None = None  # what the client asked the output to match
    grammar: CompiledGrammar | None = None  # `structured` compiled by the frontend; what the worker enforces
    # Set: an embedding request; the worker pools the prompt's final hidden states, delivered with its first token
    pooling: Pooling | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


# SamplingParams' real-valued fields: finite by admission, one float32 column each in the
# worker's persistent batch and sampling batch.
FLOAT_SAMPLING_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty")


@dataclass
class TokenLogprobs:
    """One generated token: its logprob and rank, and the request's top-N alternatives."""
    logprob: float
    rank: int  # 1: the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]  # alongside top_token_ids, most likely first


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served model's name, context and vocabulary."""
    name: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class RequestRef:
    """A request's identity across the mesh: the frontend that owns it and that frontend's key."""
    frontend_id: str
    frontend_key: int

    @property
    def key(self) -> str:
        """The scheduler's name for the request (its request_id): unique across frontends."""
        return f"{self.frontend_id}/{self.frontend_key}"

    def __str__(self) -> str:
        return self.key


@dataclass
class TraceContext:
    """A W3C trace context (empty traceparent: none), as a message that introduces a request carries it."""
    traceparent: str = ""
    tracestate: str = ""


# --- the scheduler -> detokenizer link: one step's tokens -----------------------------------------


@dataclass
class StreamStart:
    """Introduces a request to its detokenizer replica, once, ahead of its first tokens."""
    ref: RequestRef
    prompt_tail: list[int]  # the last PROMPT_TAIL_TOKENS prompt tokens, as decoding context
    sampling: SamplingParams
    num_prompt_tokens: int
    handle: int = 0  # the request's stream handle; the router numbers it
    trace_context: TraceContext = field(default_factory=TraceContext)
    # A resumed request: its earlier outputs, of whose text the client has the first resumed_text_length characters.
    resumed_output_token_ids: list[int] = field(default_factory=list)
    resumed_text_length: int = 0


Handle = TypeVar("Handle")  # what a link names a request by


@dataclass
class StepTokens(Generic[Handle]):
    """One request's news from one step: its new tokens, and its end if it ended."""
    handle: Handle  # the request's name on the link: a stream handle; the in-process engine's request id
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one row per token, for a request that asked
    error: str = ""  # non-empty: the request failed upstream; end it with this message
    # With the first token of a request that asked: one row per prompt token from the second on.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    embedding: list[float] = field(default_factory=list)  # with an embedding request's first token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TokenBatch:
    """One step's tokens for the requests one detokenizer replica serves."""
    new_requests: list[StreamStart] = field(default_factory=list)
    requests: list[StepTokens[int]] = field(default_factory=list)  # by stream handle

    def __bool__(self) -> bool:
        return bool(self.requests or self.new_requests)


# --- the detokenizer -> frontend link: one step's outputs -----------------------------------------


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass
class StreamOutput:
    """One request's output from one step: text per its output mode, and its end if it ended."""
    frontend_key: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str = ""  # non-empty: the request failed (the frontend fails it as UNAVAILABLE)
    # Beside an error: it lost its scheduler, not its worker; the frontend may submit it again.
    resumable: bool = False
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # as StepTokens carries them
    embedding: list[float] = field(default_factory=list)  # as StepTokens carries it

    @property
    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_prompt_tokens)


@dataclass
class OutputBatch:
    """One step's outputs for the requests of one frontend."""
    outputs: list[StreamOutput] = field(default_factory=list)
