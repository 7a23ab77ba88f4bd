"""`vmesh bench`'s command line."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import torch

from vmesh.services.bench import __doc__ as bench_doc
from vmesh.services.bench.claims import claims
from vmesh.services.bench.common import RESULTS, WORKLOADS, save
from vmesh.services.bench.detokenizer import detokenizer
from vmesh.services.bench.groups import HOT_PREFIX_WORKLOAD, serving_groups
from vmesh.services.bench.groups import add_arguments as add_group_arguments
from vmesh.services.bench.offline import offline
from vmesh.services.bench.online_peers import add_arguments as add_online_arguments
from vmesh.services.bench.online_peers import online
from vmesh.services.bench.serving import serving
from vmesh.services.bench.structured import ARMS, STRUCTURED_WORKLOAD, serving_structured


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmesh bench", description=bench_doc.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("--model", default=None, help="default: the embedded model")
    base.add_argument("--kv-cache-memory", default="1GiB")
    base.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    common = argparse.ArgumentParser(add_help=False, parents=[base])
    common.add_argument("--workload", default="standard",
                        help=f"{' or '.join(WORKLOADS)} (64 x 128 tokens after short prompts; 16 x 64 after "
                             "2,000-token prompts; 64 x 128 repeating the prompts' passages; 64 x 128 after distinct "
                             "256-token prompts), or a workload JSON file "
                             "of the same form; serving also takes "
                             f"{STRUCTURED_WORKLOAD} (the standard prompts answered in JSON, with and without schemas) "
                             f"and {HOT_PREFIX_WORKLOAD} (shared prefixes, one hot, over 1-3 worker groups and two "
                             "frontend routings)")
    common.add_argument("--max-tokens", type=int, default=None, help="default: the workload's")
    off = sub.add_parser("offline", parents=[common])
    off.add_argument("--requests", type=int, default=None)
    off.add_argument("--baselines", default="transformers,engine,mesh",
                     help="any of transformers, engine, engine-bf16, engine-int8-bf16, engine-int8-bf16-kv8 (the "
                          "same over the 8-bit KV cache), engine-native (in process; each "
                          "engine is also timed on the latency prompt alone, as the peers are), mesh (float32, "
                          "always run), "
                          "mesh-native (--weights native), mesh-bf16 (--dtype bfloat16), mesh-bf16-nocap (bfloat16 and "
                          "--max-prefill-tokens-with-decodes 0: prefill uncapped beside decodes), mesh-int8 (--weights "
                          "int8), mesh-int8-bf16 and mesh-int8-bf16-nocap (int8 linears in the bfloat16 mode), "
                          "mesh-int8-bf16-kv8 (and the 8-bit KV cache), "
                          "mesh-spec (n-gram speculative decoding, 4 tokens), mesh-native-spec and "
                          "mesh-int8-bf16-kv8-spec (each mode with it), "
                          "mesh-plaintext (--no-internal-tls), mesh-niced (--service-niceness 10), "
                          "mesh-lora (4 random rank-16 LoRA adapters: the "
                          "requests over all 4, then under one), mesh-final (the mesh again, each request asking "
                          "its whole output at once: final_only), and the peers vllm (float32), vllm-bf16, "
                          "vllm-bf16-fp8kv (its fp8 KV cache) and "
                          "llama.cpp (the GGUF), which need benchmarks/peers/setup.sh's environments")
    off.add_argument("--peers-dir", default=None,
                     help="where benchmarks/peers/setup.sh built the peers' environments "
                          "(default: $VMESH_PEERS_DIR, else ~/.cache/vmesh-peers)")
    off.add_argument("--repeats", type=int, default=1, help="rounds of every run, in turn; medians are reported")
    srv = sub.add_parser("serving", parents=[common])
    srv.add_argument("--address", default=None, help="a running mesh's gRPC address (default: start a mesh)")
    srv.add_argument("--backend", default=None,
                     help="(default grpc; --workload structured: openai's chat API) grpc (vmesh's API), "
                          "openai (/v1/completions of --base-url or of the started mesh), "
                          "or both: grpc,openai (in turn, or mixed with --interleave)")
    srv.add_argument("--interleave", action="store_true",
                     help="with several backends: one load, each request through one of them (balanced, "
                          "shuffled), so that latencies are compared under the same conditions")
    srv.add_argument("--base-url", default=None,
                     help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (vmesh or vLLM); "
                          "--model is then the model name it serves")
    srv.add_argument("--num-requests", type=int, default=None)
    srv.add_argument("--request-rate", type=float, default=4.0, help="Poisson arrivals per second; 0: all at once")
    srv.add_argument("--max-concurrency", type=int, default=64)
    srv.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    srv.add_argument("--slo-tpot-ms", type=float, default=200.0)
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                     help="the served model's dtype, for the mesh and the engine reference alike (default: the "
                          "worker's)")
    srv.add_argument("--weights", default=None, choices=("dequantized", "int8"),
                     help="the linears' weights, as `vmesh serve --weights` (default: the worker's)")
    srv.add_argument("--serve-flags", default="",
                     help="more `vmesh serve` flags for the mesh it starts, one string (e.g. "
                          "\"--service-niceness 10\"; a single flag as --serve-flags=--no-internal-tls); the "
                          "engine reference does not take them")
    srv.add_argument("--engine-reference", action="store_true",
                     help="after the mesh, the same schedule through the in-process engine, whose worker "
                          "thread's busy fraction and idle gaps are the reference for the mesh's worker")
    srv.add_argument("--arms", default=",".join(ARMS),
                     help="--workload structured: constrained (every request with its JSON schema as "
                          "response_format), unconstrained (the same prompts without), or both, in turn, "
                          "reporting the throughput ratio; after a constrained arm the unconstrained one "
                          "decodes as many tokens per request")
    add_group_arguments(srv)
    cl = sub.add_parser("claims", parents=[common])
    cl.add_argument("--requests", type=int, default=None)
    cl.add_argument("--models", default="embedded,tiny")
    onl = sub.add_parser("online", parents=[base],
                         help="vLLM's own serving benchmark client against vmesh serve and vLLM's OpenAI server")
    add_online_arguments(onl)
    onl.set_defaults(workload="standard")
    det = sub.add_parser("detokenizer", parents=[common])
    det.add_argument("--requests", type=int, default=None)
    det.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    return parser


MODES = {"offline": offline, "serving": serving, "claims": claims, "detokenizer": detokenizer, "online": online}


def main(argv: list[str] | None = None) -> int:
    from vmesh.services.worker.config import parse_memory_size

    args = build_parser().parse_args(argv)
    args.kv_cache_memory_bytes = parse_memory_size(args.kv_cache_memory)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    serving_only = {STRUCTURED_WORKLOAD: serving_structured, HOT_PREFIX_WORKLOAD: serving_groups}
    if args.workload in serving_only and args.mode != "serving":
        raise SystemExit(f"vmesh bench {args.mode}: the {args.workload} workload runs only in serving mode")
    run = serving_only.get(args.workload, MODES[args.mode])
    # A terminated benchmark stops the servers it started (SystemExit unwinds their stacks); by
    # default SIGTERM would leave them running.
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        result = run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    result["command"] = "vmesh bench " + " ".join(argv if argv is not None else sys.argv[1:])
    name = args.mode if args.workload == "standard" else f"{args.mode}-{Path(args.workload).stem}"
    print(f"results: {save(name, result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
