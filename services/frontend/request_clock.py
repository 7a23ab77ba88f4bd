"""One request's times, as the frontend measures them for its metrics."""

from __future__ import annotations

import time

from vmesh.services.common.metrics import FrontendMetrics
from vmesh.services.common.types import finish_name
from vmesh.services.frontend.outbox import PendingOutput


class RequestClock:
    """One request's times, measured once for both the Prometheus series (FrontendMetrics) and
    OpenTelemetry's GenAI metrics: from its arrival to its first token, between tokens, to its end."""

    def __init__(self, metrics: FrontendMetrics | None):
        self.metrics = metrics
        self.started = self.last_token_at = time.monotonic()
        self.first_token_at: float | None = None

    def observe(self, out: PendingOutput, finished: bool) -> None:
        if out.token_ids:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
                if self.metrics:
                    self.metrics.ttft.observe(now - self.started)
            elif self.metrics:  # merged outputs spread their gap over their tokens
                for _ in out.token_ids:
                    self.metrics.itl.observe((now - self.last_token_at) / len(out.token_ids))
            self.last_token_at = now
        if self.metrics and finished:
            self.metrics.e2e.observe(time.monotonic() - self.started)
            self.metrics.request_finished(finish_name(out.finish_reason))
