"""Shared fixtures: the embedded model is converted once (setup warms the cache) and loaded
once per test session."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
if not torch.cuda.is_available():
    # Triton kernels run through its interpreter on CPU; it must be chosen before they are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Tell me a short joke about computers.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook, with some detail about why it helps beginners.",
    "Name a famous painter.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Suggest a name for a pet turtle.",
    "Describe autumn in two sentences.",
    "What is the boiling point of water at sea level?",
    "Summarise the plot of Romeo and Juliet.",
]


@pytest.fixture(scope="session")
def embedded_model_dir():
    from vmesh.services.common.model_loading import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_model_dir):
    from vmesh.services.common.model_loading import load_tokenizer

    return load_tokenizer(embedded_model_dir)


@pytest.fixture(scope="session")
def embedded_reference_model(embedded_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(embedded_model_dir), dtype=torch.float32,
                                                local_files_only=True).eval()


@pytest.fixture(scope="session")
def chat_prompt_ids(embedded_tokenizer):
    return [
        embedded_tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        for p in CHAT_PROMPTS
    ]


@pytest.fixture(scope="session")
def reference_outputs(embedded_reference_model, chat_prompt_ids):
    """Greedy 32-token continuations of every chat prompt, computed once."""
    from tests.support.reference import hf_greedy

    return [hf_greedy(embedded_reference_model, p, 32) for p in chat_prompt_ids]
