"""What a client asks the mesh to generate and what it gets back, as the frontend's core holds
them, and a request as the frontend submits it to a scheduler group. Protobuf-free: the gRPC
shell decodes the public API into these (services/common/wire/public.py), the HTTP shell builds
them from OpenAI's bodies, and services/common/wire/submission.py sends a Submission."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vmesh.services.common.resume import ResumePoint
from vmesh.services.common.types import FinishReason, SamplingParams, TokenLogprobs, TraceContext, Usage


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant made, as a chat's history carries it back."""
    id: str
    name: str
    arguments: str  # JSON text (an object)


@dataclass
class ChatMessage:
    role: str  # system, user, assistant or tool
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)  # an assistant's (its content may then be "")
    tool_call_id: str = ""  # a tool's: the call this message answers


@dataclass
class Chat:
    """A conversation, to which the model's chat template is applied."""
    messages: list[ChatMessage]
    tools: str = ""  # a JSON array of tool objects, as the template takes them; "": none


# A request's input: text sent as is, a chat, or token ids (a sequence the frontend measures
# before it copies: a message may hold millions of them).
Prompt = str | Chat | Sequence[int]


@dataclass
class GenerationRequest:
    prompt: Prompt | None  # None: no input (refused)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # The client left max_tokens unset: the room the context leaves after the prompt replaces
    # sampling.max_tokens (the gRPC API's rule; OpenAI's completions say 16 instead).
    max_tokens_from_context: bool = False
    model: str = ""  # "": the served model
    priority: int = 0
    # The client's handle for resuming the stream ("": the frontend draws one), and, when this is
    # a resume (the same request sent again after its stream broke), how far the client got.
    resume_key: str = ""
    resume_from: ResumePoint | None = None

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, Chat)


@dataclass
class GenerationOutput:
    """One piece of a request's stream: new text (per its output mode), new token ids and their
    logprobs, and in its last piece the finish reason and usage."""
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    structured_backend: str = ""  # the first piece's: the grammar backend constraining the output ("": none)
    # A request with sampling.prompt_logprobs, in the piece with its first tokens: the prompt's ids
    # and one row per prompt token from the second on (prompt_logprobs[i] scores prompt_token_ids[i + 1]).
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    embedding: list[float] = field(default_factory=list)  # sampling.pooling set: in the piece with its first token
    resume_key: str = ""  # the first piece's: the handle for resuming the stream should it break
    # The first piece of a resumed stream: the text the client already has (a tool-call parser
    # picks up where the client's left off).
    resumed_text: str = ""
    resumed_token_ids: list[int] = field(default_factory=list)  # ...and the tokens it has (logprobs' offsets)


@dataclass
class Submission:
    """A request as the frontend submits it to a scheduler group, and submits it again, under a
    new frontend key, with what its client has received, when it fails over."""
    frontend_id: str
    frontend_key: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    trace_context: TraceContext = field(default_factory=TraceContext)
    detokenizers: list[str] = field(default_factory=list)  # the replicas this frontend listens to
    resumed_output_token_ids: list[int] = field(default_factory=list)
    resumed_text_length: int = 0  # characters of the resumed outputs' text the client has
    lora_name: str = ""  # the LoRA adapter the request's model names; "": the base model
    resume_key: str = ""  # the client's handle, kept across failovers and frontends ("": not resumable)
    prompt_digest: bytes = b""  # of prompt_token_ids, for a take-over's check
