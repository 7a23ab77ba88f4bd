"""SamplingParams <-> common.proto's SamplingParams. Unset optional fields take the core type's
defaults (SamplingParams()); proto3's zero is the core default of every other field."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from vmesh.services.common.types import DEFAULT_MAX_TOKENS, OutputMode, SamplingParams
from vmesh.services.common.wire.common import OUTPUT_MODES_PB, output_mode_from_proto
from vmesh.v1 import common_pb2

_DEFAULTS = SamplingParams()
_FIELDS = [f.name for f in fields(SamplingParams)]
_HAS_PRESENCE = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields if f.has_presence}


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
    return SamplingParams(**values)


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """Every field set (None ones aside), so that a later decode reads the same settings."""
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
    return pb
