"""The `vmesh` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from services.common.model_loading import CACHE_DIR_ENV


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"VMESH_{name}", default)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and worker")
    g.add_argument("--model", default=_env("MODEL"),
                   help="Hugging Face directory or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--cache-dir", default=os.environ.get(CACHE_DIR_ENV),
                   help=f"where converted GGUF models are cached (env {CACHE_DIR_ENV}; default ~/.cache/vmesh)")
    g.add_argument("--device", default=_env("DEVICE", "auto"), help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", default=_env("DTYPE", "float32"), choices=["float32", "float16", "bfloat16"])
    g.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", "16")))
    g.add_argument("--kv-cache-memory", default=_env("KV_CACHE_MEMORY"),
                   help="KV cache budget, e.g. 2GiB (default: 1GiB on CPU, a fraction of free memory on CUDA)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=float(_env("KV_CACHE_MEMORY_FRACTION", "0.9")),
                   help="on CUDA without --kv-cache-memory: fraction of free memory for the KV cache")
    g.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", "256")))
    g.add_argument("--max-model-len", type=int, default=_env("MAX_MODEL_LEN") and int(_env("MAX_MODEL_LEN")))
    g.add_argument("--attention-backend", default=_env("ATTENTION_BACKEND", "auto"),
                   choices=["auto", "torch", "triton"])
    g.add_argument("--max-num-batched-tokens", type=int, default=int(_env("MAX_NUM_BATCHED_TOKENS", "2048")))
    g.add_argument("--pipeline-depth", type=int, default=int(_env("PIPELINE_DEPTH", "2")), choices=[1, 2],
                   help="1: synchronous steps; 2: plan step N+1 while step N computes (default)")
    g.add_argument("--scheduling-policy", default=_env("SCHEDULING_POLICY", "fcfs"), choices=["fcfs", "priority"])
    g.add_argument("--no-prefix-caching", action="store_true")


def engine_config(args: argparse.Namespace):
    from services.engine.llm import EngineConfig
    from services.worker.kv_cache import parse_memory_size
    from services.worker.model_runner import WorkerConfig

    worker = WorkerConfig(
        model=args.model, cache_dir=args.cache_dir, device=args.device, dtype=args.dtype, block_size=args.block_size,
        kv_cache_memory=parse_memory_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, attention_backend=args.attention_backend)
    return EngineConfig(worker=worker, max_num_batched_tokens=args.max_num_batched_tokens,
                        policy=args.scheduling_policy, pipeline_depth=args.pipeline_depth,
                        enable_prefix_caching=not args.no_prefix_caching)


def cmd_warm_cache(args: argparse.Namespace) -> int:
    from services.common.model_loading import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(args.model, args.cache_dir)
    load_tokenizer(model_dir)
    print(f"model ready at {model_dir}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from services.common.sampling_params import SamplingParams
    from services.engine.llm import LLMEngine

    engine = LLMEngine.from_config(engine_config(args))
    prompt = engine.encode_chat([{"role": "user", "content": args.prompt}]) if not args.raw else args.prompt
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)

    async def run() -> None:
        async for out in engine.stream(prompt, params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
        sys.stdout.write("\n")

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmesh", description="LLM serving with vLLM V1's architecture over gRPC")
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    warm = sub.add_parser("warm-cache", help="convert the model once so later starts are fast")
    add_model_args(warm)
    warm.set_defaults(func=cmd_warm_cache)

    gen = sub.add_parser("generate", help="stream a completion from the model, in process")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    add_model_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from services.common.model_loading import ModelLoadError

    try:
        return args.func(args)
    except (ModelLoadError, ValueError) as exc:
        print(f"vmesh: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
