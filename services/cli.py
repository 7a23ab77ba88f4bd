"""The `vmesh` command line. Every flag can also come from the environment as VMESH_<FLAG>
(e.g. --kv-cache-memory from VMESH_KV_CACHE_MEMORY)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from vmesh.services.common.model_loading import CACHE_DIR_ENV

DEFAULT_PUBLIC_PORT = 50051
DEFAULT_HTTP_PORT = 8000


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class BadEnvironmentValue(ValueError):
    """A VMESH_* variable its flag would refuse."""


def _from_env(env: str, value: str, kwargs: dict) -> object:
    """The value VMESH_<FLAG> sets, checked as the flag itself would check it."""
    if kwargs.get("action") == "store_true":
        if value.lower() not in _TRUE + _FALSE:
            raise BadEnvironmentValue(f"{env}={value!r}: expected one of 1/0, true/false, yes/no, on/off")
        return value.lower() in _TRUE
    try:
        converted = kwargs.get("type", str)(value)
    except ValueError as exc:
        raise BadEnvironmentValue(f"{env}={value!r}: {exc}") from exc
    if kwargs.get("choices") is not None and converted not in kwargs["choices"]:
        raise BadEnvironmentValue(f"{env}={value!r}: choose from {', '.join(map(str, kwargs['choices']))}")
    return converted


def _arg(group, flag: str, **kwargs) -> None:
    """add_argument whose default can be overridden by VMESH_<FLAG>, validated as the flag is."""
    env = "VMESH_" + flag.lstrip("-").upper().replace("-", "_")
    value = os.environ.get(env)
    if value is not None:
        kwargs["default"] = _from_env(env, value, kwargs)
    kwargs["help"] = (kwargs.get("help", "") + f" [env {env}]").strip()
    group.add_argument(flag, **kwargs)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    _arg(g, "--model", default=None,
         help="Hugging Face directory or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--cache-dir", default=os.environ.get(CACHE_DIR_ENV),
                   help=f"where converted GGUF models are cached (default ~/.cache/vmesh) [env {CACHE_DIR_ENV}]")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("worker")
    _arg(g, "--device", default="auto", help="cpu, cuda, cuda:N or auto")
    _arg(g, "--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    _arg(g, "--block-size", type=int, default=16)
    _arg(g, "--kv-cache-memory", default=None,
         help="KV cache budget, e.g. 2GiB (default: 1GiB on CPU, a fraction of free memory on CUDA)")
    _arg(g, "--kv-cache-memory-fraction", type=float, default=0.9,
         help="on CUDA without --kv-cache-memory: fraction of free memory for the KV cache")
    _arg(g, "--max-num-seqs", type=int, default=256)
    _arg(g, "--max-model-len", type=int, default=None)
    _arg(g, "--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"])
    _arg(g, "--no-small-batch-linear", action="store_true",
         help="CPU: skip the 1-4 row linear kernel and the second copy of the weights it keeps")


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scheduler")
    _arg(g, "--max-num-batched-tokens", type=int, default=2048)
    _arg(g, "--pipeline-depth", type=int, default=2, choices=[1, 2],
         help="1: synchronous steps (V0); 2: plan step N+1 while step N computes")
    _arg(g, "--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    _arg(g, "--no-prefix-caching", action="store_true")
    _arg(g, "--stateless-worker", action="store_true",
         help="resend every scheduled request in full each step (V0), for measurement")
    _arg(g, "--max-waiting", type=int, default=4096, help="waiting-queue size; beyond it: RESOURCE_EXHAUSTED")


def add_server_args(parser: argparse.ArgumentParser, port: int = 0) -> None:
    g = parser.add_argument_group("server")
    _arg(g, "--host", default="127.0.0.1")
    _arg(g, "--port", type=int, default=port, help="0: any free port")
    _arg(g, "--ready-file", default=None, help="write the bound address here once listening")
    _arg(g, "--metrics-port", type=int, default=None,
         help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; default: off)")


def add_security_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security")
    _arg(g, "--tls-cert", default=None,
         help="mutual TLS between services: this service's certificate from the mesh CA, its common name "
              "its role (vmesh certs writes them); with --tls-key and --tls-ca")
    _arg(g, "--tls-key", default=None, help="the certificate's private key")
    _arg(g, "--tls-ca", default=None, help="the mesh CA: the only issuer trusted for calls between services")
    _arg(g, "--health-port", type=int, default=None,
         help="also serve the gRPC health service alone, in plaintext, on this port (for probes that cannot "
              "present a certificate, such as Kubernetes' gRPC probes; 0: any free port)")
    _arg(g, "--reflection", action="store_true", help="serve gRPC reflection (with mutual TLS: to the admin role)")


def add_frontend_args(parser: argparse.ArgumentParser, http_port: int | None) -> None:
    from vmesh.services.frontend.requests import DEFAULT_MAX_PROMPT_BYTES

    g = parser.add_argument_group("frontend")
    _arg(g, "--http-port", type=int, default=http_port,
         help="serve the OpenAI-compatible HTTP API on --host at this port (0: any free port)"
              + (f"; default {http_port}" if http_port is not None else "; default: off"))
    _arg(g, "--no-http", action="store_true", help="do not serve the HTTP API")
    _arg(g, "--api-key", default=None,
         help="require 'Authorization: Bearer KEY' on HTTP /v1/* and 'authorization: Bearer KEY' gRPC metadata "
              "on Generate/Tokenize/GetModelInfo (health checks stay open)")
    _arg(g, "--max-prompt-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES,
         help="prompts with more bytes of text are refused (INVALID_ARGUMENT / HTTP 400) before tokenizing")
    _arg(g, "--public-tls-cert", default=None,
         help="serve the public gRPC port and the HTTP API over TLS with this certificate (and --public-tls-key)")
    _arg(g, "--public-tls-key", default=None)


def add_detokenizer_discovery_args(parser: argparse.ArgumentParser) -> None:
    from vmesh.services.common.discovery import DEFAULT_REFRESH_INTERVAL_S

    g = parser.add_argument_group("detokenizer replicas")
    _arg(g, "--detokenizer-addresses", default="",
         help="comma-separated host:port entries, or dns:///name:port for every address of name")
    _arg(g, "--replica-refresh-interval", type=float, default=DEFAULT_REFRESH_INTERVAL_S,
         help="seconds between re-resolutions of dns:/// entries, so scaled-out replicas join and vanished ones leave")


def _address_specs(text: str) -> list[str]:
    """Comma-separated host:port entries or `dns:///name:port` (every address of name)."""
    return [a.strip() for a in text.split(",") if a.strip()]


def _addresses(text: str) -> list[str]:
    """The specs resolved once: for a fixed group such as worker ranks."""
    from vmesh.services.common.discovery import expand_addresses

    return expand_addresses(_address_specs(text))


def worker_config(args: argparse.Namespace):
    from vmesh.services.worker.kv_cache import parse_memory_size
    from vmesh.services.worker.model_runner import WorkerConfig

    return WorkerConfig(
        model=args.model, cache_dir=args.cache_dir, device=args.device, dtype=args.dtype, block_size=args.block_size,
        kv_cache_memory=parse_memory_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, attention_backend=args.attention_backend,
        small_batch_linear=not args.no_small_batch_linear)


def engine_config(args: argparse.Namespace):
    from vmesh.services.engine.llm import EngineConfig

    if args.stateless_worker:
        raise ValueError("--stateless-worker is a mode of the mesh's worker protocol; the in-process engine "
                         "has no protocol to resend (drop --local or the flag)")
    return EngineConfig(worker=worker_config(args), max_num_batched_tokens=args.max_num_batched_tokens,
                        policy=args.scheduling_policy, pipeline_depth=args.pipeline_depth,
                        enable_prefix_caching=not args.no_prefix_caching, max_waiting=args.max_waiting)


def _tokenizer_loader(args: argparse.Namespace):
    """The frontend's and detokenizers' tokenizer: without transformers, so without torch."""
    from vmesh.services.common.model_loading import resolve_model_dir
    from vmesh.services.common.tokenizer import load_chat_tokenizer

    return lambda: load_chat_tokenizer(resolve_model_dir(args.model, args.cache_dir))


def _model_name(args: argparse.Namespace) -> str:
    from vmesh.services.common.model_loading import EMBEDDED_MODEL_NAME

    return os.path.basename(os.path.normpath(args.model)) if args.model else EMBEDDED_MODEL_NAME


def cmd_worker(args: argparse.Namespace) -> int:
    configure_security(args, "worker")
    from vmesh.services.worker.model_runner import ModelRunner
    from vmesh.services.worker.server import serve

    config = worker_config(args)
    asyncio.run(serve(lambda: ModelRunner.load(config), _model_name(args), args.host, args.port, args.ready_file,
                      args.metrics_port))
    return 0


def cmd_detokenizer(args: argparse.Namespace) -> int:
    configure_security(args, "detokenizer")
    from vmesh.services.detokenizer.server import serve

    loader = _tokenizer_loader(args)
    asyncio.run(serve(lambda: loader().backend_tokenizer, args.host, args.port, args.ready_file, args.metrics_port,
                      _model_name(args)))
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    configure_security(args, "scheduler")
    from vmesh.services.scheduler.server import MeshSchedulerConfig, serve

    config = MeshSchedulerConfig(
        worker_addresses=_addresses(args.workers), detokenizer_addresses=_address_specs(args.detokenizer_addresses),
        replica_refresh_interval_s=args.replica_refresh_interval,
        max_num_batched_tokens=args.max_num_batched_tokens, policy=args.scheduling_policy,
        pipeline_depth=args.pipeline_depth, stateless_worker=args.stateless_worker,
        enable_prefix_caching=not args.no_prefix_caching, max_waiting=args.max_waiting)
    asyncio.run(serve(config, args.host, args.port, args.ready_file, args.metrics_port))
    return 0


def cmd_frontend(args: argparse.Namespace) -> int:
    configure_security(args, "frontend")
    from vmesh.services.frontend.server import serve

    asyncio.run(serve(_tokenizer_loader(args), _address_specs(args.scheduler),
                      _address_specs(args.detokenizer_addresses), args.host, args.port, args.ready_file,
                      args.metrics_port, args.replica_refresh_interval,
                      http_port=None if args.no_http else args.http_port, api_key=args.api_key or None,
                      max_prompt_bytes=args.max_prompt_bytes, model_name=_model_name(args)))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from vmesh.services.launcher import serve_mesh

    return serve_mesh(args)


def configure_security(args: argparse.Namespace, role: str | None) -> None:
    """This process's mTLS identity and listening options, from its flags. `role`: the role its
    certificate must carry (None: any, as for `vmesh health`)."""
    from vmesh.services.common import grpc_server, tls

    files = [getattr(args, name, None) for name in ("tls_cert", "tls_key", "tls_ca")]
    if any(files):
        if not all(files):
            raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
        identity = tls.Identity.from_files(*files)
        if role is not None and identity.role != role:
            raise ValueError(f"--tls-cert is a {identity.role} certificate; this is the {role}")
        tls.configure(identity)
    public = [getattr(args, "public_tls_cert", None), getattr(args, "public_tls_key", None)]
    if any(public) and not all(public):
        raise ValueError("--public-tls-cert and --public-tls-key go together")
    max_prompt_bytes = getattr(args, "max_prompt_bytes", None) or 0
    grpc_server.OPTIONS = grpc_server.ShellOptions(reflection=getattr(args, "reflection", False),
                                                   health_port=getattr(args, "health_port", None),
                                                   public_tls_cert=public[0], public_tls_key=public[1],
                                                   public_max_message_bytes=max(8 << 20, 2 * max_prompt_bytes))


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the service at the address reports SERVING (for container health checks)."""
    from vmesh.services.common.grpc_server import wait_until_serving

    try:
        configure_security(args, None)
        if args.tls_cert and args.role is None:
            raise ValueError("--role names the role of the service checked over mutual TLS")
        asyncio.run(wait_until_serving(args.address, args.timeout, args.role, secure=bool(args.tls_cert)))
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
    from vmesh.services.common.model_loading import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(args.model, args.cache_dir)
    load_tokenizer(model_dir)
    print(f"model ready at {model_dir}")
    from vmesh.kernels.cpu_native import CpuKernelBuildError, load_cpu_kernels
    from vmesh.services.common.model_loading import cache_dir_path

    try:
        load_cpu_kernels(cache_dir_path(args.cache_dir))
        print("CPU kernels built (kernels/cpu)")
    except CpuKernelBuildError as exc:
        print(f"CPU kernels not built ({exc}); the worker will use torch on CPU", file=sys.stderr)
    return 0


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)


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
    from vmesh.services.common.sampling_params import SamplingParams
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmesh", description="LLM serving with vLLM V1's architecture over gRPC")
    _arg(parser, "--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the whole mesh as local processes")
    add_server_args(serve, port=DEFAULT_PUBLIC_PORT)
    _arg(serve, "--detokenizers", type=int, default=1, help="detokenizer replicas")
    _arg(serve, "--data-parallel-size", type=int, default=1,
         help="worker groups, each a worker and its scheduler; the frontend spreads requests over them")
    _arg(serve, "--metrics", action="store_true", help="every service serves Prometheus metrics on a free port")
    _arg(serve, "--internal-tls", action="store_true",
         help="mutual TLS between the services, from a private CA made for this run (its admin certificate "
              "is printed, for operator tools)")
    add_frontend_args(serve, http_port=DEFAULT_HTTP_PORT)
    add_model_args(serve)
    add_worker_args(serve)
    add_scheduler_args(serve)
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser("worker", help="run a worker (model, KV cache, persistent batch)")
    add_server_args(worker)
    add_security_args(worker)
    add_model_args(worker)
    add_worker_args(worker)
    worker.set_defaults(func=cmd_worker)

    scheduler = sub.add_parser("scheduler", help="run the scheduler")
    add_server_args(scheduler)
    add_security_args(scheduler)
    _arg(scheduler, "--workers", required=False, default="", help="worker rank addresses, comma-separated")
    add_detokenizer_discovery_args(scheduler)
    add_scheduler_args(scheduler)
    scheduler.set_defaults(func=cmd_scheduler)

    detok = sub.add_parser("detokenizer", help="run a detokenizer replica")
    add_server_args(detok)
    add_security_args(detok)
    add_model_args(detok)
    detok.set_defaults(func=cmd_detokenizer)

    frontend = sub.add_parser("frontend", help="run a frontend (the public API)")
    add_server_args(frontend, port=DEFAULT_PUBLIC_PORT)
    add_security_args(frontend)
    _arg(frontend, "--scheduler", default="127.0.0.1:50052",
         help="scheduler addresses, one per worker group (data parallelism): host:port entries, comma-separated, "
              "or dns:///name:port, re-resolved like the detokenizers")
    add_detokenizer_discovery_args(frontend)
    add_frontend_args(frontend, http_port=None)
    add_model_args(frontend)
    frontend.set_defaults(func=cmd_frontend)

    sub.add_parser("bench", help="benchmarks: offline, serving, claims, detokenizer (vmesh bench -h)")

    health = sub.add_parser("health", help="exit 0 if a service reports SERVING")
    health.add_argument("address")
    health.add_argument("--timeout", type=float, default=3.0)
    # Plaintext unless --tls-* are given on the command line. Deliberately not read from VMESH_TLS_*:
    # a container's own identity is in its environment, and its health check must still reach the
    # plaintext health port (--health-port) it probes.
    health.add_argument("--role", default=None, choices=["frontend", "scheduler", "worker", "detokenizer"],
                        help="with --tls-*: the role of the service checked (its certificate must be that role's)")
    health.add_argument("--tls-cert", default=None, help="a certificate from the mesh CA (e.g. the admin one)")
    health.add_argument("--tls-key", default=None)
    health.add_argument("--tls-ca", default=None)
    health.set_defaults(func=cmd_health)

    certs = sub.add_parser("certs", help="make a private CA and a certificate per role for mutual TLS")
    certs.add_argument("--out", required=True, help="directory to write ca.crt and <role>.crt/.key into")
    certs.add_argument("--public-hosts", default="",
                       help="comma-separated DNS names or IPs: also write public.crt/.key for the public port")
    certs.add_argument("--key-mode", default="600", help="octal mode of the key files (640: a group may read)")
    certs.add_argument("--if-missing", action="store_true", help="keep certificates already in --out")
    certs.set_defaults(func=cmd_certs)

    warm = sub.add_parser("warm-cache", help="convert the model once so later starts are fast")
    add_model_args(warm)
    warm.set_defaults(func=cmd_warm_cache)

    gen = sub.add_parser("generate", help="stream a completion from a running mesh")
    gen.add_argument("prompt")
    _arg(gen, "--address", default=f"127.0.0.1:{DEFAULT_PUBLIC_PORT}", help="the mesh's frontend")
    _arg(gen, "--api-key", default=None, help="sent as 'authorization: Bearer KEY'")
    _arg(gen, "--public-tls-ca", default=None, help="the CA of a frontend serving TLS (--public-tls-cert)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--local", action="store_true", help="run the engine in this process instead of a mesh")
    _sampling_args(gen)
    add_model_args(gen)
    add_worker_args(gen)
    add_scheduler_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with a running mesh")
    _arg(chat, "--address", default=f"127.0.0.1:{DEFAULT_PUBLIC_PORT}")
    _arg(chat, "--api-key", default=None, help="sent as 'authorization: Bearer KEY'")
    _arg(chat, "--public-tls-ca", default=None, help="the CA of a frontend serving TLS (--public-tls-cert)")
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    for subparser in sub.choices.values():  # also accepted after the subcommand
        subparser.add_argument("--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING or ERROR")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # its own parser, in services/bench/
        from vmesh.services.bench.cli import main as bench_main

        return bench_main(argv[1:])
    from vmesh.services.launcher import die_with_launcher

    die_with_launcher()
    try:
        parser = build_parser()
    except BadEnvironmentValue as exc:
        print(f"vmesh: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import grpc

    from vmesh.services.common.model_loading import ModelLoadError

    try:
        return args.func(args)
    except (ModelLoadError, ValueError) as exc:
        print(f"vmesh: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:  # a client command that could not get its answer: one line, not a traceback
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        reason = "no service answers there" if code == grpc.StatusCode.UNAVAILABLE else (
            exc.details() if callable(getattr(exc, "details", None)) else str(exc))
        print(f"vmesh: {getattr(args, 'address', 'the mesh')}: {code.name if code else 'error'}: {reason}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
