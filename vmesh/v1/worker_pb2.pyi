from vmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerInfoResponse(_message.Message):
    __slots__ = ("model_name", "num_kv_blocks", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "max_num_seqs", "tensor_parallel_size", "num_speculative_tokens", "speculative_disable_by_batch_size", "lora_adapters", "max_loras", "lora_adapter_paths", "kv_cache_group_windows")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_DISABLE_BY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_PATHS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_num_seqs: int
    tensor_parallel_size: int
    num_speculative_tokens: int
    speculative_disable_by_batch_size: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    lora_adapter_paths: _containers.RepeatedScalarFieldContainer[str]
    kv_cache_group_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_name: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_num_seqs: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., speculative_disable_by_batch_size: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., lora_adapter_paths: _Optional[_Iterable[str]] = ..., kv_cache_group_windows: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("handle", "token_ids", "num_prompt_tokens", "sampling", "block_ids", "num_computed_tokens", "trace_context", "lora_name")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    handle: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    trace_context: _common_pb2.TraceContext
    lora_name: str
    def __init__(self, handle: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("step", "new_requests", "removed_handles", "scheduled_handles", "num_scheduled_tokens", "new_block_ids", "num_new_blocks", "full_state", "num_draft_slots")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FULL_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    removed_handles: _containers.RepeatedScalarFieldContainer[int]
    scheduled_handles: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    full_state: bool
    num_draft_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., removed_handles: _Optional[_Iterable[int]] = ..., scheduled_handles: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., full_state: _Optional[bool] = ..., num_draft_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("step", "handles", "sampled_token_ids", "num_sampled_tokens", "num_draft_tokens", "logprobs_handles", "logprobs", "forward_seconds", "sampling_seconds", "failed_handles", "failure_messages", "timing", "prompt_logprobs_handles", "prompt_logprobs", "embedding_handles", "embeddings")
    STEP_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_HANDLES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_HANDLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_HANDLES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    step: int
    handles: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_sampled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs_handles: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _common_pb2.LogprobColumns
    forward_seconds: float
    sampling_seconds: float
    failed_handles: _containers.RepeatedScalarFieldContainer[int]
    failure_messages: _containers.RepeatedScalarFieldContainer[str]
    timing: StepTiming
    prompt_logprobs_handles: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _common_pb2.LogprobColumns
    embedding_handles: _containers.RepeatedScalarFieldContainer[int]
    embeddings: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step: _Optional[int] = ..., handles: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., num_sampled_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., logprobs_handles: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ..., forward_seconds: _Optional[float] = ..., sampling_seconds: _Optional[float] = ..., failed_handles: _Optional[_Iterable[int]] = ..., failure_messages: _Optional[_Iterable[str]] = ..., timing: _Optional[_Union[StepTiming, _Mapping]] = ..., prompt_logprobs_handles: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ..., embedding_handles: _Optional[_Iterable[int]] = ..., embeddings: _Optional[_Iterable[float]] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("plan_wait_seconds", "plan_decode_seconds", "execute_seconds", "received_to_done_seconds", "has_previous", "idle_before_seconds", "waited_for_plan_seconds", "rows", "tokens")
    PLAN_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_TO_DONE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HAS_PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    IDLE_BEFORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAITED_FOR_PLAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    plan_wait_seconds: float
    plan_decode_seconds: float
    execute_seconds: float
    received_to_done_seconds: float
    has_previous: bool
    idle_before_seconds: float
    waited_for_plan_seconds: float
    rows: int
    tokens: int
    def __init__(self, plan_wait_seconds: _Optional[float] = ..., plan_decode_seconds: _Optional[float] = ..., execute_seconds: _Optional[float] = ..., received_to_done_seconds: _Optional[float] = ..., has_previous: _Optional[bool] = ..., idle_before_seconds: _Optional[float] = ..., waited_for_plan_seconds: _Optional[float] = ..., rows: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class GetWorkerStatsRequest(_message.Message):
    __slots__ = ("timeline_from_step",)
    TIMELINE_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    timeline_from_step: int
    def __init__(self, timeline_from_step: _Optional[int] = ...) -> None: ...

class Distribution(_message.Message):
    __slots__ = ("p50", "p90", "p99", "max", "mean", "count")
    P50_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    p50: float
    p90: float
    p99: float
    max: float
    mean: float
    count: int
    def __init__(self, p50: _Optional[float] = ..., p90: _Optional[float] = ..., p99: _Optional[float] = ..., max: _Optional[float] = ..., mean: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class StepTimelineSummary(_message.Message):
    __slots__ = ("steps", "busy_seconds", "span_seconds", "idle_gap", "waited_for_plan", "plan_wait", "plan_decode", "result_encode", "rows")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_GAP_FIELD_NUMBER: _ClassVar[int]
    WAITED_FOR_PLAN_FIELD_NUMBER: _ClassVar[int]
    PLAN_WAIT_FIELD_NUMBER: _ClassVar[int]
    PLAN_DECODE_FIELD_NUMBER: _ClassVar[int]
    RESULT_ENCODE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    busy_seconds: float
    span_seconds: float
    idle_gap: Distribution
    waited_for_plan: Distribution
    plan_wait: Distribution
    plan_decode: Distribution
    result_encode: Distribution
    rows: Distribution
    def __init__(self, steps: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., span_seconds: _Optional[float] = ..., idle_gap: _Optional[_Union[Distribution, _Mapping]] = ..., waited_for_plan: _Optional[_Union[Distribution, _Mapping]] = ..., plan_wait: _Optional[_Union[Distribution, _Mapping]] = ..., plan_decode: _Optional[_Union[Distribution, _Mapping]] = ..., result_encode: _Optional[_Union[Distribution, _Mapping]] = ..., rows: _Optional[_Union[Distribution, _Mapping]] = ...) -> None: ...

class GetWorkerStatsResponse(_message.Message):
    __slots__ = ("steps", "busy_seconds", "wall_seconds", "duty_cycle", "bytes_received", "num_rows", "timeline")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    steps: int
    busy_seconds: float
    wall_seconds: float
    duty_cycle: float
    bytes_received: int
    num_rows: int
    timeline: StepTimelineSummary
    def __init__(self, steps: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., wall_seconds: _Optional[float] = ..., duty_cycle: _Optional[float] = ..., bytes_received: _Optional[int] = ..., num_rows: _Optional[int] = ..., timeline: _Optional[_Union[StepTimelineSummary, _Mapping]] = ...) -> None: ...
