"""Gemma 3 270M, the optional real model (the `gemma` extra): its GGUF, vmesh's converted
directory, transformers' float32 model loaded from the same GGUF (the parity oracle), and
plain-text completion prompts (it is a base model) of chosen token lengths."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import torch

from tests.support.prerequisites import missing


def gemma3_files() -> tuple[Path, Path]:
    """(the assembled GGUF, vmesh's converted directory); skips (fails in CI) without the extra."""
    from vmesh.services.common.model_loading import (
        GEMMA3_MODEL_ALIAS,
        GEMMA3_PACKAGE,
        ModelLoadError,
        packaged_gemma3_file,
        resolve_model_dir,
    )

    try:
        gguf = packaged_gemma3_file()
    except ModelLoadError as exc:
        missing(f"{exc}", f"CI installs the gemma extra ({GEMMA3_PACKAGE}; VMESH_GEMMA=1 in .ci/run)")
    return gguf, resolve_model_dir(GEMMA3_MODEL_ALIAS)


def reference_model(gguf: Path) -> Any:
    """transformers' own GGUF loading and dequantization, float32: independent of vmesh's conversion."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                local_files_only=True).eval()


# Standard-library modules whose docstrings make the prompts: English prose and code, the same on
# every machine with this Python.
_CORPUS_MODULES = ("argparse", "collections", "dataclasses", "functools", "json", "logging", "pathlib", "subprocess",
                   "threading", "inspect", "doctest", "unittest", "typing", "csv", "string", "heapq", "bisect",
                   "textwrap", "difflib", "pickle")


def _corpus() -> str:
    return "\n\n".join(inspect.getdoc(importlib.import_module(name)) or "" for name in _CORPUS_MODULES)


SHORT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "import numpy as np\n\n# Compute the mean of each column\n",
    "Water boils at",
    "The first law of thermodynamics states that",
    "Here is a recipe for pancakes:\n1.",
    "In 1969, the Apollo 11 mission",
    "SELECT name, age FROM users WHERE",
)


def long_prompt(tokenizer: Any, tokens: int, offset: int = 0) -> list[int]:
    """`tokens` ids of the corpus (BOS first), starting `offset` tokens in; the corpus repeats
    where it is shorter."""
    ids = tokenizer.encode(_corpus(), add_special_tokens=False)
    body = (ids * (1 + (offset + tokens) // len(ids)))[offset:offset + tokens - 1]
    return [tokenizer.encode("", add_special_tokens=True)[0], *body] if tokens > 1 else body[:1]
