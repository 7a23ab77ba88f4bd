"""`--speculative-config`: the JSON object vLLM takes, parsed once into a SpeculativeConfig.
Free of torch (the worker's settings import it)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from vmesh.services.common.config_flags import json_object_flag

METHODS = ("ngram", "suffix")
# The crossover measured on 2 AVX-512 cores (python -m benchmarks.spec_crossover; benchmarks/README.md):
# with fewer requests in flight drafts paid on outputs that repeat their prompts (3.3x at 1, 1.3x at
# 8) and cost nothing on ordinary ones (1.00-1.07x); from 16 on a step is bound by arithmetic and
# verifying drafts cost 13 % on ordinary prompts while gaining 2-9 % on repeating ones.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
# The suffix method's cache holds up to 1,024 tokens a request on average at 16 bytes a token
# (recent_outputs.py), so vLLM's default of 10,000 requests is the bound: up to 160 MiB.
MAX_CACHED_REQUESTS = 10_000
# The JSON values each annotation takes (an int is a float's value too).
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float)}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram": prompt lookup; "suffix": the longest suffix match, drafts scaled by its length
    num_speculative_tokens: int  # k: the most tokens proposed for one row in one step
    prompt_lookup_min: int = 2  # ngram: the shortest suffix of the row's tokens that may match
    prompt_lookup_max: int = 5  # ngram: the longest suffix compared
    suffix_decoding_max_tree_depth: int = 24  # suffix: the longest suffix compared
    # suffix: a match of m tokens proposes at most spec_factor * m of them (short matches guess less).
    suffix_decoding_max_spec_factor: float = 1.0
    # suffix: the outputs of this many recent requests are matched too (recent_outputs.py); 0: off.
    suffix_decoding_max_cached_requests: int = 0
    # Steps with this many running requests or more propose nothing (0: never off by batch size).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: choose from {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if not 1 <= self.suffix_decoding_max_tree_depth <= 64:
            raise ValueError("suffix_decoding_max_tree_depth must be in [1, 64]")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError("suffix_decoding_max_spec_factor must be positive")
        if not 0 <= self.suffix_decoding_max_cached_requests <= MAX_CACHED_REQUESTS:
            raise ValueError(f"suffix_decoding_max_cached_requests must be in [0, {MAX_CACHED_REQUESTS}]")
        if self.suffix_decoding_max_cached_requests and self.method != "suffix":
            raise ValueError("suffix_decoding_max_cached_requests needs method 'suffix'")
        if self.disable_by_batch_size < 0:
            raise ValueError("disable_by_batch_size must be >= 0")

    @property
    def max_match_length(self) -> int:
        """How far back a row's suffix is compared."""
        return self.prompt_lookup_max if self.method == "ngram" else self.suffix_decoding_max_tree_depth

    @property
    def min_match_length(self) -> int:
        return self.prompt_lookup_min if self.method == "ngram" else 1


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """'{"method": "ngram", "num_speculative_tokens": 4, ...}' -> SpeculativeConfig; '' -> None
    (no speculation). Unknown keys and wrong types are refused with ValueError."""
    if not text.strip():
        return None
    known = {f.name: f for f in fields(SpeculativeConfig)}
    raw = json_object_flag("--speculative-config", text, known)
    for required in ("method", "num_speculative_tokens"):
        if required not in raw:
            raise ValueError(f"--speculative-config needs {required!r}")
    for name, value in raw.items():
        expected = _FIELD_TYPES[str(known[name].type)]
        if isinstance(value, bool) or not isinstance(value, expected):
            raise ValueError(f"--speculative-config: {name} must be {known[name].type}, got {value!r}")
    return SpeculativeConfig(**raw)


def checked_speculative_config(text: str) -> str:
    """The flag's argparse type: the text as given (forwarded as it is), refused here if it does not parse."""
    parse_speculative_config(text)
    return text
