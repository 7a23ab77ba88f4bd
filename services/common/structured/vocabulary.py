"""A model's vocabulary as each grammar backend wants it, built from its tokenizer.json alone
(the `tokenizers` library; no transformers), and the tokenizer identity grammar keys hash."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import llguidance
import tokenizers
import xgrammar


@dataclass(frozen=True)
class Vocabulary:
    """One model's tokenizer as both backends see it. `vocab_size` is the logits' width, which may
    exceed the tokenizer's own vocabulary (padding rows never match a grammar)."""
    xgrammar_info: xgrammar.TokenizerInfo
    llguidance_tokenizer: llguidance.LLTokenizer
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    identity: str  # hex sha256 over the tokenizer.json, vocab_size and the stop tokens


def tokenizer_json_text(tokenizer_json: str | Path | bytes) -> str:
    """tokenizer.json's text: given as its path, or as its content (bytes, or a str starting with "{")."""
    if isinstance(tokenizer_json, bytes):
        return tokenizer_json.decode()
    if isinstance(tokenizer_json, str) and tokenizer_json.lstrip().startswith("{"):
        return tokenizer_json
    return Path(tokenizer_json).read_text()


def _xgrammar_info(text: str, vocab_size: int, stop_token_ids: list[int]) -> xgrammar.TokenizerInfo:
    """What xgrammar's from_huggingface does for a fast tokenizer, from tokenizer.json: the vocab
    type and prefix-space rule read from the serialized tokenizer, the vocabulary's own evidence
    (byte-level or byte-fallback pieces) preferred where the two disagree."""
    vocab = tokenizers.Tokenizer.from_str(text).get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for piece, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = piece
    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(text)
    vocab_type = xgrammar.TokenizerInfo._detect_vocab_type_from_vocab(vocab) or metadata["vocab_type"]
    return xgrammar.TokenizerInfo(encoded, vocab_type=vocab_type, vocab_size=vocab_size,
                                  stop_token_ids=stop_token_ids or None, add_prefix_space=metadata["add_prefix_space"])


def build_vocabulary(tokenizer_json: str | Path | bytes, vocab_size: int, stop_token_ids: list[int]) -> Vocabulary:
    text = tokenizer_json_text(tokenizer_json)
    identity = hashlib.sha256(json.dumps([hashlib.sha256(text.encode()).hexdigest(), vocab_size,
                                          sorted(stop_token_ids)]).encode()).hexdigest()
    return Vocabulary(
        xgrammar_info=_xgrammar_info(text, vocab_size, stop_token_ids),
        llguidance_tokenizer=llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None),
        vocab_size=vocab_size, stop_token_ids=tuple(stop_token_ids), identity=identity)


_cached: dict[tuple[str, int, tuple[int, ...]], Vocabulary] = {}
_cached_lock = threading.Lock()
# The digest of each tokenizer.json file read so far, by (path, size, modification time): the
# worker asks for its vocabulary with every constrained request it adds, and reading and hashing
# a 3.5 MB file each time cost 20-60 ms of its step loop per request.
_file_digests: dict[tuple[str, int, int], str] = {}


def _file_key(tokenizer_json: str | Path | bytes) -> tuple[str, int, int] | None:
    """(path, size, mtime) of a tokenizer.json given as a path; None for one given as content."""
    if isinstance(tokenizer_json, bytes) or (isinstance(tokenizer_json, str)
                                             and tokenizer_json.lstrip().startswith("{")):
        return None
    stat = Path(tokenizer_json).stat()
    return str(Path(tokenizer_json).resolve()), stat.st_size, stat.st_mtime_ns


def shared_vocabulary(tokenizer_json: str | Path | bytes, vocab_size: int, stop_token_ids: list[int]) -> Vocabulary:
    """build_vocabulary, once per process per tokenizer (building takes about a second)."""
    file_key = _file_key(tokenizer_json)
    text = None
    with _cached_lock:
        digest = _file_digests.get(file_key) if file_key else None
    if digest is None:
        text = tokenizer_json_text(tokenizer_json)
        digest = hashlib.sha256(text.encode()).hexdigest()
    cache_key = (digest, vocab_size, tuple(stop_token_ids))
    with _cached_lock:
        if file_key:
            _file_digests[file_key] = digest
        if cache_key not in _cached:
            _cached[cache_key] = build_vocabulary(text or tokenizer_json_text(tokenizer_json), vocab_size,
                                                  stop_token_ids)
        return _cached[cache_key]
