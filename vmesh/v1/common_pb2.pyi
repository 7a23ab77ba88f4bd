from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_MODE_UNSPECIFIED: _ClassVar[OutputMode]
    OUTPUT_MODE_DELTA: _ClassVar[OutputMode]
    OUTPUT_MODE_CUMULATIVE: _ClassVar[OutputMode]
    OUTPUT_MODE_FINAL_ONLY: _ClassVar[OutputMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingType]
    POOLING_TYPE_LAST: _ClassVar[PoolingType]
    POOLING_TYPE_MEAN: _ClassVar[PoolingType]
    POOLING_TYPE_CLS: _ClassVar[PoolingType]

class StructuredKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRUCTURED_KIND_UNSPECIFIED: _ClassVar[StructuredKind]
    STRUCTURED_KIND_JSON_SCHEMA: _ClassVar[StructuredKind]
    STRUCTURED_KIND_JSON_OBJECT: _ClassVar[StructuredKind]
    STRUCTURED_KIND_REGEX: _ClassVar[StructuredKind]
    STRUCTURED_KIND_CHOICE: _ClassVar[StructuredKind]
    STRUCTURED_KIND_GRAMMAR: _ClassVar[StructuredKind]
    STRUCTURED_KIND_STRUCTURAL_TAG: _ClassVar[StructuredKind]
OUTPUT_MODE_UNSPECIFIED: OutputMode
OUTPUT_MODE_DELTA: OutputMode
OUTPUT_MODE_CUMULATIVE: OutputMode
OUTPUT_MODE_FINAL_ONLY: OutputMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
POOLING_TYPE_UNSPECIFIED: PoolingType
POOLING_TYPE_LAST: PoolingType
POOLING_TYPE_MEAN: PoolingType
POOLING_TYPE_CLS: PoolingType
STRUCTURED_KIND_UNSPECIFIED: StructuredKind
STRUCTURED_KIND_JSON_SCHEMA: StructuredKind
STRUCTURED_KIND_JSON_OBJECT: StructuredKind
STRUCTURED_KIND_REGEX: StructuredKind
STRUCTURED_KIND_CHOICE: StructuredKind
STRUCTURED_KIND_GRAMMAR: StructuredKind
STRUCTURED_KIND_STRUCTURAL_TAG: StructuredKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids", "stop", "include_stop_str_in_output", "skip_special_tokens", "logprobs", "output_mode", "structured", "grammar", "prompt_logprobs", "pooling")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logprobs: int
    output_mode: OutputMode
    structured: StructuredOutput
    grammar: CompiledGrammar
    prompt_logprobs: int
    pooling: Pooling
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., logprobs: _Optional[int] = ..., output_mode: _Optional[_Union[OutputMode, str]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., grammar: _Optional[_Union[CompiledGrammar, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., pooling: _Optional[_Union[Pooling, _Mapping]] = ...) -> None: ...

class Pooling(_message.Message):
    __slots__ = ("type", "normalize")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    type: PoolingType
    normalize: bool
    def __init__(self, type: _Optional[_Union[PoolingType, str]] = ..., normalize: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "source", "backend")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    kind: StructuredKind
    source: str
    backend: str
    def __init__(self, kind: _Optional[_Union[StructuredKind, str]] = ..., source: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class CompiledGrammar(_message.Message):
    __slots__ = ("backend", "key", "payload")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    backend: str
    key: str
    payload: bytes
    def __init__(self, backend: _Optional[str] = ..., key: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class LogprobColumns(_message.Message):
    __slots__ = ("sampled_logprobs", "sampled_ranks", "num_top", "top_token_ids", "top_logprobs")
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sampled_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampled_ranks: _containers.RepeatedScalarFieldContainer[int]
    num_top: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sampled_logprobs: _Optional[_Iterable[float]] = ..., sampled_ranks: _Optional[_Iterable[int]] = ..., num_top: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("traceparent", "tracestate")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    tracestate: str
    def __init__(self, traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class LoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoraAdapterResponse(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...
