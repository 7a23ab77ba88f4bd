"""Large CPU tensors (weights, the KV block pool) on transparent huge pages.

Page walks over the pool's scattered blocks and the weight streams cost 3-10 % of a CPU decode
step without them (benchmarks/README.md). torch's allocator reads THP_MEM_ALLOC_ENABLE once, at
its first allocation, so a process that serves (the `vmesh` command, and through it every service
the launcher starts, which inherit its environment) calls this before it imports torch. Importing
vmesh changes nothing; THP_MEM_ALLOC_ENABLE=0 in the environment turns it off."""

from __future__ import annotations

import os

VARIABLE = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages() -> None:
    os.environ.setdefault(VARIABLE, "1")
