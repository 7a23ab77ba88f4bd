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
                       enable_prefix_caching=True, seed=0)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> None:
        params = self.params(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class LlamaCppPeer:
    def __init__(self, config: dict[str, Any]):
        from llama_cpp import Llama

        self.llm = Llama(model_path=config["gguf"], n_ctx=config["max_model_len"], n_threads=config["threads"],
                         n_threads_batch=config["threads"], n_batch=512, seed=0, verbose=False)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> None:
        # llama-cpp-python's high-level API serves one sequence at a time.
        for prompt in prompts:
            out = self.llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, top_k=1,
                                             logit_bias={self.llm.token_eos(): float("-inf")})
            assert out["usage"]["completion_tokens"] == max_tokens, out["usage"]

    def reset_prefix_cache(self) -> None:
        self.llm.reset()


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
