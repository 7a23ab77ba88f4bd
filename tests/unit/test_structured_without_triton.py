"""The CPU image uninstalls Triton, which xgrammar names as a requirement on Linux x86_64 but
uses only for CUDA tensors: compiling, matching and masking on the CPU must work without it."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError, as in the CPU image
import json
import torch
from vmesh.services.common.structured import GrammarCompiler, allocate_token_bitmask, apply_token_bitmask, load_matcher
from vmesh.services.common.types import StructuredOutput

tokenizer_json, vocab, eos = sys.argv[1], 49152, [2]
schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
grammar = GrammarCompiler(tokenizer_json, vocab, eos).compile(
    StructuredOutput("json_schema", json.dumps(schema), backend="xgrammar"))
matcher = load_matcher(grammar, tokenizer_json, vocab, eos)
mask = allocate_token_bitmask(1, vocab)
matcher.fill_bitmask(mask, 0)
logits = torch.zeros(1, vocab)
apply_token_bitmask(logits, mask)
allowed = int(torch.isfinite(logits).sum())
assert 0 < allowed < vocab, allowed
assert "triton" not in [m for m, v in sys.modules.items() if v is not None]
print("allowed", allowed)
"""


def test_xgrammar_compiles_matches_and_masks_without_triton(embedded_model_dir):
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(embedded_model_dir / "tokenizer.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("allowed ")
