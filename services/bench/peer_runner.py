"""Drives a peer engine (vLLM or llama.cpp) for `vmesh bench offline`, inside the peer's own
environment: run as a script by that environment's interpreter, so it imports nothing of
vmesh. It loads the engine once, then answers one JSON line per command read from stdin:

    generate  -> {"tokens_per_s": ...}   every prompt, greedy, EOS ignored, timed as one batch
    latency   -> {"ttft_ms", "cached_ttft_ms", "mean_itl_ms"}  the latency prompt alone
    quit

Both peers are timed the way the benchmark times vmesh's in-process engine: wall time of a
blocking call on token ids. Latency without a streaming API: TTFT is the time of a
one-token request, ITL the extra time per token of a full-length one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


class VllmPeer:
    def __init__(self, config: dict[str, Any]):
        from vllm import LLM, SamplingParams

        self.params = SamplingParams
        self.llm = LLM(model=config["model_dir"], dtype=config["dtype"], max_model_len=config["max_model_len"],
                       kv_cache_dtype=config.get("kv_cache_dtype", "auto"), enable_prefix_caching=True, seed=0)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> None:
        params = self.params(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class LlamaCppPeer:
    """llama.cpp as its server batches with parallel slots: every sequence of a round in one
    context (a slot and a KV stream each), prompts decoded together in batches of up to
    BATCH_TOKENS tokens, then one token per live sequence per `llama_decode`; a slot keeps what
    its last request left in its cache and reuses the common prefix (the server's cache_prompt).
    llama-cpp-python's high-level API serves one sequence at a time, which is not llama.cpp's
    throughput; its low-level bindings are llama.cpp's C API."""

    BATCH_TOKENS = 2048  # tokens per llama_decode (llama.cpp's server default n_batch)
    UBATCH_TOKENS = 512  # its default physical batch

    def __init__(self, config: dict[str, Any]):
        import llama_cpp as lib
        import numpy

        self.lib, self.numpy = lib, numpy
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(config["gguf"].encode(), lib.llama_model_default_params())
        self.sequences = min(config.get("requests") or 64, lib.llama_max_parallel_sequences())
        params = lib.llama_context_default_params()
        with open(config["workload"]) as f:
            workload = json.load(f)
        longest = max(len(p) for p in [*workload["prompt_token_ids"], workload["latency_prompt_token_ids"]])
        # A KV stream per slot (kv_unified off): each token attends over its own sequence's cells
        # only, which is llama.cpp's advice for sequences that share no long prefix.
        params.n_ctx = self.sequences * min(config["max_model_len"], longest + config["max_tokens"])
        params.n_batch = self.BATCH_TOKENS
        params.n_ubatch = self.UBATCH_TOKENS
        params.n_seq_max = self.sequences
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = config["threads"]
        self.ctx = lib.llama_init_from_model(self.model, params)
        vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(vocab)
        self.eos = lib.llama_vocab_eos(vocab)
        self.batch = lib.llama_batch_init(self.BATCH_TOKENS, 0, 1)
        self.memory = lib.llama_get_memory(self.ctx)
        self.cached: dict[int, list[int]] = {}  # slot -> the tokens its KV stream holds

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> Any:
        """One llama_decode of (token, position, sequence, wants logits) entries; the logits rows."""
        batch = self.batch
        for i, (token, pos, seq, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, wants
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        if (status := self.lib.llama_decode(self.ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        rows = sum(1 for entry in entries if entry[3])
        return self.numpy.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))

    def _greedy(self, logits: Any) -> list[int]:
        logits[:, self.eos] = float("-inf")  # EOS ignored, as every engine's run here
        return [int(t) for t in logits.argmax(axis=1)]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outputs = []
        for start in range(0, len(prompts), self.sequences):
            outputs += self._generate(prompts[start:start + self.sequences], max_tokens)
        return outputs

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        pending = []
        for seq, prompt in enumerate(prompts):
            kept = self._reusable(seq, prompt)
            self.lib.llama_memory_seq_rm(self.memory, seq, kept, -1)
            pending += [(prompt[pos], pos, seq, pos == len(prompt) - 1) for pos in range(kept, len(prompt))]
        last: dict[int, int] = {}
        for start in range(0, len(pending), self.BATCH_TOKENS):
            chunk = pending[start:start + self.BATCH_TOKENS]
            sampled = self._greedy(self._decode(chunk))
            last.update(zip([seq for _, _, seq, wants in chunk if wants], sampled))
        outputs = {seq: [token] for seq, token in last.items()}
        for step in range(1, max_tokens):
            entries = [(outputs[seq][-1], len(prompts[seq]) + step - 1, seq, True) for seq in sorted(outputs)]
            for seq, token in zip(sorted(outputs), self._greedy(self._decode(entries))):
                outputs[seq].append(token)
        assert all(len(out) == max_tokens for out in outputs.values()) and len(outputs) == len(prompts)
        for seq, prompt in enumerate(prompts):
            self.cached[seq] = prompt + outputs[seq][:-1]  # the last sampled token was never decoded
        return [outputs[seq] for seq in range(len(prompts))]

    def _reusable(self, seq: int, prompt: list[int]) -> int:
        """How many of the prompt's tokens the slot already holds (at most all but the last,
        whose logits are needed)."""
        held = self.cached.get(seq, [])
        common, limit = 0, min(len(held), len(prompt) - 1)
        while common < limit and held[common] == prompt[common]:
            common += 1
        return common

    def reset_prefix_cache(self) -> None:
        self.lib.llama_memory_clear(self.memory, False)
        self.cached.clear()


PEERS: dict[str, type[VllmPeer | LlamaCppPeer]] = {"vllm": VllmPeer, "llama.cpp": LlamaCppPeer}


def timed(fn: Any, *args: Any) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def main() -> None:
    # Replies go to the original stdout; whatever the engine prints, from Python or from C,
    # goes to stderr (the benchmark's log of this peer) instead of into the replies.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    config = json.loads(sys.argv[1])
    with open(config["workload"]) as f:
        workload = json.load(f)
    prompts = workload["prompt_token_ids"][:config["requests"]]
    latency_prompt = workload["latency_prompt_token_ids"]
    max_tokens = config["max_tokens"]
    peer = PEERS[config["engine"]](config)
    peer.generate(prompts[:1], 2)  # warm-up
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "generate":
            peer.reset_prefix_cache()  # every round starts cold, as vmesh's do
            elapsed = timed(peer.generate, prompts, max_tokens)
            reply: dict[str, Any] = {"tokens_per_s": len(prompts) * max_tokens / elapsed}
        elif command == "latency":
            peer.reset_prefix_cache()
            peer.generate(prompts[:1], 2)
            first = timed(peer.generate, [latency_prompt], 1)
            repeated = timed(peer.generate, [latency_prompt], 1)
            full = timed(peer.generate, [latency_prompt], max_tokens)
            reply = {"ttft_ms": first * 1e3, "cached_ttft_ms": repeated * 1e3,
                     "mean_itl_ms": (full - repeated) / max(max_tokens - 1, 1) * 1e3}
        elif command == "quit":
            return
        else:
            reply = {"error": f"unknown command {command!r}"}
        print(json.dumps(reply), file=replies, flush=True)


if __name__ == "__main__":
    main()
