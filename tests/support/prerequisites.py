"""What a test does when something it needs from outside Python is missing: on a developer's
machine it is skipped, saying what to install; under CI (CI=1, as .ci/run sets it), which provides
every prerequisite, a missing one is a failure, not a silent skip."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(reason: str, in_ci: str) -> NoReturn:
    """`reason`: the skip's message; `in_ci`: the failure's, where CI should have provided it."""
    if os.environ.get("CI"):
        pytest.fail(f"{in_ci}: {reason}")
    pytest.skip(reason)
