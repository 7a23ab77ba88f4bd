"""vmesh services: one sub-package per service, and `common` for what they share."""

import os

# Large CPU tensors (weights, the KV block pool) on transparent huge pages: page walks over the
# pool's scattered blocks and the weight streams cost 3-10 % of a CPU decode step without them
# (benchmarks/README.md). torch's allocator reads this once, at its first allocation, so it is
# set here, before any service module imports torch; THP_MEM_ALLOC_ENABLE=0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
