"""Per-request generation settings: one definition shared by every service."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

# Below this a temperature means greedy; dividing by it would overflow the logits.
GREEDY_TEMPERATURE_EPS = 1e-5


class OutputMode(Enum):
    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: off; N >= 0: sampled token's logprob plus the top N
    output_mode: OutputMode = OutputMode.DELTA

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS
