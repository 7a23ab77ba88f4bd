from vmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequestRequest(_message.Message):
    __slots__ = ("frontend_id", "frontend_key", "prompt_token_ids", "sampling", "priority", "trace_context", "detokenizers", "resumed_output_token_ids", "resumed_text_length", "lora_name", "resume_key", "prompt_digest")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZERS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    RESUME_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    frontend_key: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    trace_context: _common_pb2.TraceContext
    detokenizers: _containers.RepeatedScalarFieldContainer[str]
    resumed_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resumed_text_length: int
    lora_name: str
    resume_key: str
    prompt_digest: bytes
    def __init__(self, frontend_id: _Optional[str] = ..., frontend_key: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., detokenizers: _Optional[_Iterable[str]] = ..., resumed_output_token_ids: _Optional[_Iterable[int]] = ..., resumed_text_length: _Optional[int] = ..., lora_name: _Optional[str] = ..., resume_key: _Optional[str] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class SubmitRequestResponse(_message.Message):
    __slots__ = ("detokenizer",)
    DETOKENIZER_FIELD_NUMBER: _ClassVar[int]
    detokenizer: str
    def __init__(self, detokenizer: _Optional[str] = ...) -> None: ...

class TakeOverRequestRequest(_message.Message):
    __slots__ = ("resume_key", "prompt_digest", "num_output_tokens")
    RESUME_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    resume_key: str
    prompt_digest: bytes
    num_output_tokens: int
    def __init__(self, resume_key: _Optional[str] = ..., prompt_digest: _Optional[bytes] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class TakeOverRequestResponse(_message.Message):
    __slots__ = ("output_token_ids",)
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequestRequest(_message.Message):
    __slots__ = ("frontend_id", "frontend_key")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_KEY_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    frontend_key: int
    def __init__(self, frontend_id: _Optional[str] = ..., frontend_key: _Optional[int] = ...) -> None: ...

class AbortRequestResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetSchedulerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSchedulerStatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_used_blocks", "num_free_blocks", "num_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "steps", "plan_bytes_sent", "pipeline_depth", "stateless_worker", "model_name", "max_model_len", "vocab_size", "decode_steps", "decode_plan_bytes", "incarnation", "lora_adapters", "num_draft_tokens", "num_accepted_tokens")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAN_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    STATELESS_WORKER_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PLAN_BYTES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    steps: int
    plan_bytes_sent: int
    pipeline_depth: int
    stateless_worker: bool
    model_name: str
    max_model_len: int
    vocab_size: int
    decode_steps: int
    decode_plan_bytes: int
    incarnation: str
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: int
    num_accepted_tokens: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., steps: _Optional[int] = ..., plan_bytes_sent: _Optional[int] = ..., pipeline_depth: _Optional[int] = ..., stateless_worker: _Optional[bool] = ..., model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., decode_steps: _Optional[int] = ..., decode_plan_bytes: _Optional[int] = ..., incarnation: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("num_dropped_blocks",)
    NUM_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_dropped_blocks: int
    def __init__(self, num_dropped_blocks: _Optional[int] = ...) -> None: ...

class WatchCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheUpdate(_message.Message):
    __slots__ = ("snapshot", "block_size", "hash_seed", "stored", "removed", "load", "incarnation")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    block_size: int
    hash_seed: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    load: SchedulerLoad
    incarnation: str
    def __init__(self, snapshot: _Optional[bool] = ..., block_size: _Optional[int] = ..., hash_seed: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., load: _Optional[_Union[SchedulerLoad, _Mapping]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class SchedulerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "num_waiting_prompt_tokens", "adapter_requests", "max_loras")
    class AdapterRequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_waiting_prompt_tokens: int
    adapter_requests: _containers.ScalarMap[str, int]
    max_loras: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_waiting_prompt_tokens: _Optional[int] = ..., adapter_requests: _Optional[_Mapping[str, int]] = ..., max_loras: _Optional[int] = ...) -> None: ...
