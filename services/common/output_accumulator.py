"""A request's outputs gathered in arrival order: the one merge rule for every place that adds
up a stream of outputs (the frontend's outbox, the HTTP responses, the engine's `generate`,
the Python client's `complete`). Protobuf-free: the logprob entries are whatever the stream
carries."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, Self, TypeVar

from vmesh.services.common.types import OutputMode

Logprobs = TypeVar("Logprobs")


@dataclass
class OutputAccumulator(Generic[Logprobs]):
    """Token ids and logprobs always arrive new; text per the output mode: new text in delta
    mode, the whole text so far in cumulative mode, and in final-only mode nothing until the
    whole text at the end. So outside delta mode the latest text is the whole, and an output
    without text (an error's, or a final-only one's before the end) leaves it as it is."""

    delta_text: bool = True
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)

    @classmethod
    def for_mode(cls, mode: OutputMode) -> Self:
        return cls(delta_text=mode is OutputMode.DELTA)

    def extend(self, text: str, token_ids: Iterable[int], logprobs: Iterable[Logprobs] = ()) -> None:
        if self.delta_text:
            # Taken out of the attribute first, so the string has one reference and CPython grows it
            # in place: `self.text + text` copied the whole text for every delta (quadratic in length).
            whole, self.text = self.text, ""
            whole += text
            self.text = whole
        else:
            self.text = text or self.text
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
