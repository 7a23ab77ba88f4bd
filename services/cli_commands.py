"""What each `vmesh` subcommand does, given its parsed arguments (services/cli.py parses them).
Each service's settings are rebuilt from the flags by the dataclasses that define them, once,
and passed whole to its serve(): its own, and its ServerSettings (where it listens, who it is)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from vmesh.services.common.config_flags import values_from_args
from vmesh.services.common.model_loading import (
    EMBEDDED_MODEL_NAME,
    cache_dir_path,
    load_tokenizer,
    resolve_model_dir,
)
from vmesh.services.common.server_settings import PublicPort, ServerSettings
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.settings import SchedulerServiceSettings, SchedulerSettings
from vmesh.services.worker.config import WorkerConfig

if TYPE_CHECKING:
    from vmesh.services.engine.llm import EngineConfig


def _address_specs(text: str) -> list[str]:
    """Comma-separated host:port entries or `dns:///name:port` (every address of name)."""
    return [a.strip() for a in text.split(",") if a.strip()]


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(**values_from_args(WorkerConfig, args))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from vmesh.services.engine.llm import EngineConfig  # torch: only for a command that runs the engine

    return EngineConfig(worker=worker_config(args), **values_from_args(SchedulerSettings, args))


def _tokenizer_loader(args: argparse.Namespace):
    """The frontend's and detokenizers' tokenizer: without transformers, so without torch."""
    from vmesh.services.common.tokenizer import load_chat_tokenizer

    return lambda: load_chat_tokenizer(resolve_model_dir(args.model, args.cache_dir), args.chat_template)


def _model_name(args: argparse.Namespace) -> str:
    return os.path.basename(os.path.normpath(args.model)) if args.model else EMBEDDED_MODEL_NAME


def cmd_worker(args: argparse.Namespace) -> int:
    server = ServerSettings.from_args(args, "worker")
    from vmesh.services.worker.model_runner import ModelRunner
    from vmesh.services.worker.server import serve

    config = worker_config(args)
    asyncio.run(serve(lambda: ModelRunner.load(config), _model_name(args), server))
    _exit_without_teardown()


def _exit_without_teardown() -> NoReturn:
    """Exit 0 once a service has drained and stopped, its output flushed, without the
    interpreter's teardown: in a worker that is torch's (seconds of freeing and garbage
    collection that the process's exit does anyway), and a stopping mesh waits for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cmd_detokenizer(args: argparse.Namespace) -> int:
    server = ServerSettings.from_args(args, "detokenizer")
    from vmesh.services.detokenizer.server import serve

    loader = _tokenizer_loader(args)
    asyncio.run(serve(lambda: loader().backend_tokenizer, _model_name(args), server))
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    server = ServerSettings.from_args(args, "scheduler")
    from vmesh.services.scheduler.server import serve

    asyncio.run(serve(SchedulerServiceSettings(**values_from_args(SchedulerServiceSettings, args)), server))
    return 0


def cmd_frontend(args: argparse.Namespace) -> int:
    server = ServerSettings.from_args(args, "frontend")
    public = PublicPort.for_prompts(args.public_tls_cert, args.public_tls_key, args.max_prompt_bytes)
    from vmesh.services.frontend.server import serve
    from vmesh.services.frontend.settings import FrontendServiceSettings, FrontendSettings

    settings = FrontendServiceSettings(
        scheduler_addresses=_address_specs(args.scheduler),
        detokenizer_addresses=_address_specs(args.detokenizer_addresses),
        replica_refresh_interval_s=args.replica_refresh_interval, model_name=_model_name(args),
        **values_from_args(FrontendSettings, args))
    asyncio.run(serve(settings, _tokenizer_loader(args), server, public,
                      lambda: resolve_model_dir(args.model, args.cache_dir)))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from vmesh.services.launcher import serve_mesh

    return serve_mesh(args)


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the service at the address reports SERVING (for container health checks)."""
    from vmesh.services.common.grpc_server import wait_until_serving

    try:
        identity = ServerSettings.from_args(args, None).identity
        if identity is not None and args.role is None:
            raise ValueError("--role names the role of the service checked over mutual TLS")
        asyncio.run(wait_until_serving(args.address, args.timeout, args.role, secure=identity is not None,
                                       identity=identity))
    except TimeoutError as exc:
        print(f"vmesh: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    """A private CA and a certificate per role for one mesh (compose and Kubernetes mount them)."""
    from vmesh.services.common.certs import write_mesh_certificates

    if args.if_missing and (Path(args.out) / "ca.crt").exists():
        print(f"vmesh: certificates already in {args.out}; kept")
        return 0
    directory = write_mesh_certificates(Path(args.out), public_hosts=_address_specs(args.public_hosts),
                                        key_mode=int(args.key_mode, 8))
    print(f"vmesh: CA and certificates for every role in {directory}")
    return 0


def cmd_warm_cache(args: argparse.Namespace) -> int:
    model_dir = resolve_model_dir(args.model, args.cache_dir)
    load_tokenizer(model_dir)
    print(f"model ready at {model_dir}")
    from vmesh.kernels.cpu_native import CpuKernelBuildError, load_cpu_kernels

    try:
        load_cpu_kernels(cache_dir_path(args.cache_dir))
        print("CPU kernels built (vmesh/kernels/cpu)")
    except CpuKernelBuildError as exc:
        print(f"CPU kernels not built ({exc}); the worker will use torch on CPU", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.local:
        return _generate_in_process(args)
    from vmesh.services.client import VmeshClient

    async def run() -> None:
        async with VmeshClient(args.address, api_key=args.api_key, tls_ca=args.public_tls_ca) as client:
            chat = None if args.raw else [{"role": "user", "content": args.prompt}]
            async for out in client.generate(text=args.prompt if args.raw else None, chat=chat,
                                             max_tokens=args.max_tokens, temperature=args.temperature,
                                             top_p=args.top_p, top_k=args.top_k, seed=args.seed):
                sys.stdout.write(out.text)
                sys.stdout.flush()
        sys.stdout.write("\n")

    asyncio.run(run())
    return 0


def _generate_in_process(args: argparse.Namespace) -> int:
    from vmesh.services.engine.llm import LLMEngine

    engine = LLMEngine.from_config(engine_config(args))
    prompt = args.prompt if args.raw else engine.encode_chat([{"role": "user", "content": args.prompt}])
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


def cmd_chat(args: argparse.Namespace) -> int:
    from vmesh.services.client import VmeshClient

    async def run() -> None:
        history: list[dict[str, str]] = []
        async with VmeshClient(args.address, api_key=args.api_key, tls_ca=args.public_tls_ca) as client:
            while True:
                try:
                    line = await asyncio.get_running_loop().run_in_executor(None, input, "you> ")
                except EOFError:
                    return
                if not line.strip():
                    continue
                history.append({"role": "user", "content": line})
                sys.stdout.write("assistant> ")
                reply = ""
                async for out in client.generate(chat=history, max_tokens=args.max_tokens,
                                                 temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                                 seed=args.seed):
                    reply += out.text
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                history.append({"role": "assistant", "content": reply})

    asyncio.run(run())
    return 0
