"""What a scheduler tells the frontends of its prefix cache and load (its WatchCache stream), so
that every frontend routes on the same exact view of every group rather than on its own guesses."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from vmesh.services.common.prefix_hash import adapter_root, iter_block_hashes

# Prefixes are matched over at most their first 4,096 tokens: past that, two prompts that share
# them are as good as equal for routing, and the lookup stays bounded.
MAX_MATCHED_TOKENS = 4096


@dataclass(frozen=True)
class SchedulerLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_waiting_prompt_tokens: int = 0  # prompt tokens of waiting requests not computed yet
    # (LoRA adapter, requests running or waiting with it), by name: the adapters its workers hold
    # in slots, or are about to. max_loras: how many one step may use (0: the group serves none).
    adapter_requests: tuple[tuple[str, int], ...] = ()
    max_loras: int = 0

    @property
    def requests(self) -> int:
        return self.num_running + self.num_waiting


@dataclass
class CacheUpdate:
    """One message of the stream: a snapshot (`stored` is the whole cache) or the changes since
    the message before. Blocks are named by their chained hashes (prefix_hash.py)."""
    snapshot: bool
    block_size: int
    hash_seed: int  # the parent of a prompt's first block
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    load: SchedulerLoad = field(default_factory=SchedulerLoad)
    incarnation: str = ""


class CacheView:
    """A group's prefix cache and load as a frontend knows them from the stream: exact as of the
    last message, plus the requests this frontend sent there since (not in that message's load)."""

    def __init__(self, first: CacheUpdate):
        if not first.snapshot:
            raise ValueError("a cache view starts from a snapshot")
        self.blocks: set[int] = set()
        self.block_size = first.block_size
        self.hash_seed = first.hash_seed
        self.load = first.load
        self.sent_since_update = 0
        self.adapters_sent_since_update: Counter[str] = Counter()
        self.apply(first)

    def apply(self, update: CacheUpdate) -> None:
        if update.snapshot:
            self.blocks = set(update.stored)
            self.block_size, self.hash_seed = update.block_size, update.hash_seed
        else:
            self.blocks.difference_update(update.removed)
            self.blocks.update(update.stored)
        self.load = update.load
        self.sent_since_update = 0
        self.adapters_sent_since_update.clear()

    def sent(self, lora_name: str = "") -> None:
        """This frontend sent the group a request (under `lora_name`) since its last report."""
        self.sent_since_update += 1
        if lora_name:
            self.adapters_sent_since_update[lora_name] += 1

    @property
    def requests(self) -> int:
        """Requests running or waiting there, by the last report and what this frontend sent since."""
        return self.load.requests + self.sent_since_update

    def adapter_requests(self, lora_name: str) -> int:
        """Requests there under LoRA adapter `lora_name`, counted as `requests` is."""
        return dict(self.load.adapter_requests).get(lora_name, 0) + self.adapters_sent_since_update[lora_name]

    def active_adapters(self) -> set[str]:
        """The adapters some request there uses: held in a slot, or about to be."""
        return {name for name, _ in self.load.adapter_requests} | set(+self.adapters_sent_since_update)

    def cached_tokens(self, prompt: Sequence[int], lora_name: str = "") -> int:
        """How many leading tokens of `prompt` (under the LoRA adapter `lora_name`; "": the base
        model) the group holds in whole cached blocks."""
        found = 0
        for block_hash in iter_block_hashes(prompt, self.block_size, adapter_root(self.hash_seed, lora_name),
                                            max_blocks=MAX_MATCHED_TOKENS // self.block_size):
            if block_hash not in self.blocks:
                break
            found += 1
        return found * self.block_size
