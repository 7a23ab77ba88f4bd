"""SamplingParams <-> common.proto's SamplingParams. Unset optional fields take the core type's
defaults (SamplingParams()); proto3's zero is the core default of every other field. The
structured-output request and its compiled grammar are messages; unset, they are None."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from vmesh.services.common.types import (
    DEFAULT_MAX_TOKENS,
    STRUCTURED_KINDS,
    CompiledGrammar,
    OutputMode,
    Pooling,
    PoolingType,
    SamplingParams,
    StructuredOutput,
)
from vmesh.services.common.wire.common import OUTPUT_MODES_PB, output_mode_from_proto
from vmesh.v1 import common_pb2

_DEFAULTS = SamplingParams()
_MESSAGE_FIELDS = ("structured", "grammar", "pooling")
_FIELDS = [f.name for f in fields(SamplingParams) if f.name not in _MESSAGE_FIELDS]
_HAS_PRESENCE = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields if f.has_presence}

STRUCTURED_KINDS_PB = {kind: common_pb2.StructuredKind.Value(f"STRUCTURED_KIND_{kind.upper()}")
                       for kind in STRUCTURED_KINDS}
_STRUCTURED_KINDS = {code: kind for kind, code in STRUCTURED_KINDS_PB.items()}
POOLING_TYPES_PB = {t: common_pb2.PoolingType.Value(f"POOLING_TYPE_{t.value}") for t in PoolingType}
_POOLING_TYPES = {code: t for t, code in POOLING_TYPES_PB.items()}


def structured_to_proto(s: StructuredOutput) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(kind=STRUCTURED_KINDS_PB.get(s.kind, common_pb2.STRUCTURED_KIND_UNSPECIFIED),
                                       source=s.source, backend=s.backend)


def structured_from_proto(pb: common_pb2.StructuredOutput) -> StructuredOutput:
    """An UNSPECIFIED (or newer) kind reads as "" which admission refuses; an empty backend is "auto"."""
    return StructuredOutput(_STRUCTURED_KINDS.get(pb.kind, ""), pb.source, pb.backend or "auto")


def grammar_to_proto(g: CompiledGrammar) -> common_pb2.CompiledGrammar:
    return common_pb2.CompiledGrammar(backend=g.backend, key=g.key, payload=g.payload)


def grammar_from_proto(pb: common_pb2.CompiledGrammar) -> CompiledGrammar:
    return CompiledGrammar(pb.backend, pb.key, pb.payload)


def pooling_to_proto(p: Pooling) -> common_pb2.Pooling:
    return common_pb2.Pooling(type=POOLING_TYPES_PB[p.type], normalize=p.normalize)


def pooling_from_proto(pb: common_pb2.Pooling) -> Pooling:
    """An UNSPECIFIED (or newer) type reads as LAST, the decoder models' default."""
    return Pooling(_POOLING_TYPES.get(pb.type, PoolingType.LAST), pb.normalize)


def sampling_from_proto(pb: common_pb2.SamplingParams, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    """The one translation of the proto into SamplingParams. Doors (frontend, scheduler) reach it
    through admission.admit, which checks the result."""
    values: dict[str, Any] = {}
    for name in _FIELDS:
        if name == "output_mode":
            values[name] = output_mode_from_proto(pb.output_mode)
        elif name in _HAS_PRESENCE and not pb.HasField(name):
            values[name] = default_max_tokens if name == "max_tokens" else getattr(_DEFAULTS, name)
        else:
            value = getattr(pb, name)
            values[name] = list(value) if isinstance(getattr(_DEFAULTS, name), list) else value
    values["structured"] = structured_from_proto(pb.structured) if pb.HasField("structured") else None
    values["grammar"] = grammar_from_proto(pb.grammar) if pb.HasField("grammar") else None
    values["pooling"] = pooling_from_proto(pb.pooling) if pb.HasField("pooling") else None
    return SamplingParams(**values)


def sampling_to_proto(p: SamplingParams, with_grammar: bool = True) -> common_pb2.SamplingParams:
    """Every field set (None ones aside), so that a later decode reads the same settings.
    with_grammar=False leaves the compiled grammar out: for a link whose far end does not
    enforce it (the detokenizer), the payload is dead weight."""
    pb = common_pb2.SamplingParams()
    for name in _FIELDS:
        value = getattr(p, name)
        if value is None:
            continue
        if isinstance(value, OutputMode):
            pb.output_mode = OUTPUT_MODES_PB[value]
        elif isinstance(value, list):
            getattr(pb, name).extend(value)
        else:
            setattr(pb, name, value)
    if p.structured is not None:
        pb.structured.CopyFrom(structured_to_proto(p.structured))
    if p.grammar is not None and with_grammar:
        pb.grammar.CopyFrom(grammar_to_proto(p.grammar))
    if p.pooling is not None:
        pb.pooling.CopyFrom(pooling_to_proto(p.pooling))
    return pb
