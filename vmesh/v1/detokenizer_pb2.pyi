from vmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DetokenizerRequestInfo(_message.Message):
    __slots__ = ("handle", "frontend_id", "frontend_key", "prompt_tail", "sampling", "num_prompt_tokens", "trace_context", "resumed_output_token_ids", "resumed_text_length")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TAIL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    handle: int
    frontend_id: str
    frontend_key: int
    prompt_tail: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    num_prompt_tokens: int
    trace_context: _common_pb2.TraceContext
    resumed_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resumed_text_length: int
    def __init__(self, handle: _Optional[int] = ..., frontend_id: _Optional[str] = ..., frontend_key: _Optional[int] = ..., prompt_tail: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., resumed_output_token_ids: _Optional[_Iterable[int]] = ..., resumed_text_length: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("new_requests", "handles", "num_tokens", "token_ids", "finish_reasons", "num_cached_prompt_tokens", "logprobs_handles", "logprobs", "errors", "prompt_logprobs_handles", "prompt_logprobs", "embedding_handles", "embeddings")
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_HANDLES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_HANDLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_HANDLES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    new_requests: _containers.RepeatedCompositeFieldContainer[DetokenizerRequestInfo]
    handles: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reasons: _containers.RepeatedScalarFieldContainer[_common_pb2.FinishReason]
    num_cached_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs_handles: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _common_pb2.LogprobColumns
    errors: _containers.RepeatedScalarFieldContainer[str]
    prompt_logprobs_handles: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _common_pb2.LogprobColumns
    embedding_handles: _containers.RepeatedScalarFieldContainer[int]
    embeddings: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, new_requests: _Optional[_Iterable[_Union[DetokenizerRequestInfo, _Mapping]]] = ..., handles: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reasons: _Optional[_Iterable[_Union[_common_pb2.FinishReason, str]]] = ..., num_cached_prompt_tokens: _Optional[_Iterable[int]] = ..., logprobs_handles: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ..., errors: _Optional[_Iterable[str]] = ..., prompt_logprobs_handles: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ..., embedding_handles: _Optional[_Iterable[int]] = ..., embeddings: _Optional[_Iterable[float]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("stopped_handles", "draining", "orphaned_handles")
    STOPPED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ORPHANED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    stopped_handles: _containers.RepeatedScalarFieldContainer[int]
    draining: bool
    orphaned_handles: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stopped_handles: _Optional[_Iterable[int]] = ..., draining: _Optional[bool] = ..., orphaned_handles: _Optional[_Iterable[int]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("frontend_id",)
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    def __init__(self, frontend_id: _Optional[str] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("frontend_keys", "texts", "num_tokens", "token_ids", "finish_reasons", "num_prompt_tokens", "num_output_tokens", "num_cached_prompt_tokens", "num_logprobs_rows", "logprobs", "errors", "resumable", "num_prompt_logprobs_rows", "prompt_logprobs", "embedding_sizes", "embeddings")
    FRONTEND_KEYS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_ROWS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    frontend_keys: _containers.RepeatedScalarFieldContainer[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reasons: _containers.RepeatedScalarFieldContainer[_common_pb2.FinishReason]
    num_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_output_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_cached_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_logprobs_rows: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _common_pb2.LogprobColumns
    errors: _containers.RepeatedScalarFieldContainer[str]
    resumable: _containers.RepeatedScalarFieldContainer[bool]
    num_prompt_logprobs_rows: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _common_pb2.LogprobColumns
    embedding_sizes: _containers.RepeatedScalarFieldContainer[int]
    embeddings: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, frontend_keys: _Optional[_Iterable[int]] = ..., texts: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reasons: _Optional[_Iterable[_Union[_common_pb2.FinishReason, str]]] = ..., num_prompt_tokens: _Optional[_Iterable[int]] = ..., num_output_tokens: _Optional[_Iterable[int]] = ..., num_cached_prompt_tokens: _Optional[_Iterable[int]] = ..., num_logprobs_rows: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ..., errors: _Optional[_Iterable[str]] = ..., resumable: _Optional[_Iterable[bool]] = ..., num_prompt_logprobs_rows: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ..., embedding_sizes: _Optional[_Iterable[int]] = ..., embeddings: _Optional[_Iterable[float]] = ...) -> None: ...
