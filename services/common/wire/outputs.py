"""The detokenizer -> frontend link: OutputBatch <-> SubscribeResponse, columns by frontend key."""

from __future__ import annotations

from vmesh.services.common.types import OutputBatch, StreamOutput
from vmesh.services.common.wire.common import (
    finish_from_proto,
    finish_to_proto,
    owners_of_counts,
    pack_owned,
    pack_vectors,
    unpack_owned,
    unpack_vectors,
)
from vmesh.v1 import detokenizer_pb2


def to_proto(batch: OutputBatch) -> detokenizer_pb2.SubscribeResponse:
    pb = detokenizer_pb2.SubscribeResponse()
    for o in batch.outputs:
        pb.frontend_keys.append(o.frontend_key)
        pb.texts.append(o.text)
        pb.num_tokens.append(len(o.token_ids))
        pb.token_ids.extend(o.token_ids)
        pb.finish_reasons.append(finish_to_proto(o.finish_reason))
        pb.num_prompt_tokens.append(o.num_prompt_tokens)
        pb.num_output_tokens.append(o.num_output_tokens)
        pb.num_cached_prompt_tokens.append(o.num_cached_prompt_tokens)
        pb.num_logprobs_rows.append(len(o.logprobs))
        pb.errors.append(o.error)
        pb.resumable.append(o.resumable)
        pb.num_prompt_logprobs_rows.append(len(o.prompt_logprobs))
        pb.embedding_sizes.append(len(o.embedding))
    pack_owned(enumerate(o.logprobs for o in batch.outputs), pb.logprobs)
    pack_owned(enumerate(o.prompt_logprobs for o in batch.outputs), pb.prompt_logprobs)
    pack_vectors(enumerate(o.embedding for o in batch.outputs), pb.embeddings)
    return pb


def from_proto(pb: detokenizer_pb2.SubscribeResponse) -> OutputBatch:
    n_keys = len(pb.frontend_keys)
    logprobs = unpack_owned(owners_of_counts(pb.num_logprobs_rows), pb.logprobs)
    prompt_logprobs = unpack_owned(owners_of_counts(pb.num_prompt_logprobs_rows), pb.prompt_logprobs)
    embeddings = unpack_vectors([i for i, size in enumerate(pb.embedding_sizes) if size], pb.embeddings)
    # Repeated fields index slowly: each column is read into a list once (every step, every request).
    token_ids, num_tokens, texts = list(pb.token_ids), list(pb.num_tokens), list(pb.texts)
    finishes = [finish_from_proto(code) for code in pb.finish_reasons]
    usage = [_column(pb.num_prompt_tokens, n_keys), _column(pb.num_output_tokens, n_keys),
             _column(pb.num_cached_prompt_tokens, n_keys)]
    errors = list(pb.errors) or [""] * n_keys  # per key, or absent when nothing failed
    resumable = list(pb.resumable) or [False] * n_keys
    outputs = []
    offset = 0
    for i, frontend_key in enumerate(pb.frontend_keys):
        n = num_tokens[i]
        outputs.append(StreamOutput(
            frontend_key, texts[i], token_ids[offset:offset + n], finishes[i], usage[0][i], usage[1][i], usage[2][i],
            logprobs.get(i, []), errors[i], resumable[i], prompt_logprobs.get(i, []), embeddings.get(i, [])))
        offset += n
    return OutputBatch(outputs)


def _column(column, n: int) -> list[int]:
    """A usage column's values, 0 past its end: a batch that only fails requests may leave usage out."""
    values = list(column)
    return values + [0] * (n - len(values))
