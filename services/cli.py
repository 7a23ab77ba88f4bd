"""The `vmesh` command line. Every flag can also come from the environment as VMESH_<FLAG>
(e.g. --kv-cache-memory from VMESH_KV_CACHE_MEMORY). The model, worker, scheduler and frontend
flags are the settings dataclasses' fields (services/common/config_flags.py); what each
subcommand then does is in services/cli_commands.py."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Collection
from typing import Any

from vmesh.services.cli_commands import (
    cmd_certs,
    cmd_chat,
    cmd_detokenizer,
    cmd_frontend,
    cmd_generate,
    cmd_health,
    cmd_scheduler,
    cmd_serve,
    cmd_warm_cache,
    cmd_worker,
)
from vmesh.services.common.config_flags import BadEnvironmentValue, add_option, add_settings
from vmesh.services.common.huge_pages import prefer_huge_pages
from vmesh.services.common.model_loading import ModelLoadError
from vmesh.services.common.types import SERVICE_ROLES
from vmesh.services.flag_groups import SETTINGS_GROUPS
from vmesh.services.frontend.settings import HTTP_PORT_HELP
from vmesh.services.mesh_settings import MeshSettings
from vmesh.services.worker.config import PER_WORKER_PROCESS

DEFAULT_PUBLIC_PORT = 50051
DEFAULT_HTTP_PORT = 8000
DEFAULT_FRONTEND = f"127.0.0.1:{DEFAULT_PUBLIC_PORT}"

AddFlags = Callable[[argparse.ArgumentParser], None]


def add_settings_group(parser: argparse.ArgumentParser, group: str, defaults: dict[str, Any] | None = None,
                       helps: dict[str, str] | None = None, skip: Collection[str] = ()) -> None:
    """The argument group `group`: one flag per field of its settings dataclass (but `skip`)."""
    add_settings(parser.add_argument_group(group), SETTINGS_GROUPS[group], group, defaults, helps, skip)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    add_settings_group(parser, "model")


def add_worker_args(parser: argparse.ArgumentParser, skip: Collection[str] = ()) -> None:
    add_settings_group(parser, "worker", skip=skip)


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    add_settings_group(parser, "scheduler")


def add_server_args(parser: argparse.ArgumentParser, port: int = 0) -> None:
    add_settings_group(parser, "server", {"port": port})


def add_security_args(parser: argparse.ArgumentParser) -> None:
    add_settings_group(parser, "security")


def add_frontend_args(parser: argparse.ArgumentParser, http_port: int | None) -> None:
    # `vmesh serve` turns the HTTP API on by default; a lone frontend leaves it off.
    overrides = {} if http_port is None else {"http_port": http_port}
    helps = {} if http_port is None else {"http_port": f"{HTTP_PORT_HELP}; default {http_port}"}
    add_settings_group(parser, "frontend", overrides, helps)


def add_detokenizer_discovery_args(parser: argparse.ArgumentParser) -> None:
    add_settings_group(parser, "detokenizer replicas")


def _service_args(port: int = 0) -> list[AddFlags]:
    """The flags every service process takes: where it listens and its mutual TLS."""
    return [lambda p: add_server_args(p, port), add_security_args]


def _serve_args(parser: argparse.ArgumentParser) -> None:
    # --metrics (MeshSettings) gives every service a metrics port; one port cannot serve them all.
    add_settings_group(parser, "server", {"port": DEFAULT_PUBLIC_PORT}, skip=("metrics_port",))
    add_settings(parser, MeshSettings, "mesh")  # the launcher's own: among the command's plain options
    add_frontend_args(parser, http_port=DEFAULT_HTTP_PORT)
    add_model_args(parser)
    add_worker_args(parser, skip=PER_WORKER_PROCESS)  # the launcher gives each rank its own
    add_scheduler_args(parser)


def _worker_addresses(parser: argparse.ArgumentParser) -> None:
    add_settings_group(parser, "worker ranks")


def _scheduler_addresses(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--scheduler", default="127.0.0.1:50052",
               help="scheduler addresses, one per worker group (data parallelism): host:port entries, "
                    "comma-separated, or dns:///name:port, re-resolved like the detokenizers")


def _health_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address")
    parser.add_argument("--timeout", type=float, default=3.0)
    # Plaintext unless --tls-* are given on the command line. Deliberately not read from VMESH_TLS_*:
    # a container's own identity is in its environment, and its health check must still reach the
    # plaintext health port (--health-port) it probes.
    parser.add_argument("--role", default=None, choices=SERVICE_ROLES,
                        help="with --tls-*: the role of the service checked (its certificate must be that role's)")
    parser.add_argument("--tls-cert", default=None, help="a certificate from the mesh CA (e.g. the admin one)")
    parser.add_argument("--tls-key", default=None)
    parser.add_argument("--tls-ca", default=None)


def _certs_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory to write ca.crt and <role>.crt/.key into")
    parser.add_argument("--public-hosts", default="",
                        help="comma-separated DNS names or IPs: also write public.crt/.key for the public port")
    parser.add_argument("--key-mode", default="600", help="octal mode of the key files (640: a group may read)")
    parser.add_argument("--if-missing", action="store_true", help="keep certificates already in --out")


def _client_args(parser: argparse.ArgumentParser) -> None:
    """A client of a running mesh: where its frontend is and how to reach it; the sampling settings."""
    add_option(parser, "--address", default=DEFAULT_FRONTEND, help="the mesh's frontend")
    add_option(parser, "--api-key", default=None, help="sent as 'authorization: Bearer KEY'")
    add_option(parser, "--public-tls-ca", default=None, help="the CA of a frontend serving TLS (--public-tls-cert)")


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)


def _generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt")
    _client_args(parser)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--local", action="store_true", help="run the engine in this process instead of a mesh")
    _sampling_args(parser)
    add_model_args(parser)
    add_worker_args(parser)
    add_scheduler_args(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmesh", description="LLM serving with vLLM V1's architecture over gRPC")
    add_option(parser, "--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str, func: Callable[[argparse.Namespace], int], *flags: AddFlags) -> None:
        subcommand = sub.add_parser(name, help=help_text)
        for add in flags:
            add(subcommand)
        subcommand.set_defaults(func=func)

    command("serve", "start the whole mesh as local processes", cmd_serve, _serve_args)
    command("worker", "run a worker (model, KV cache, persistent batch)", cmd_worker,
            *_service_args(), add_model_args, add_worker_args)
    command("scheduler", "run the scheduler", cmd_scheduler,
            *_service_args(), _worker_addresses, add_detokenizer_discovery_args, add_scheduler_args)
    command("detokenizer", "run a detokenizer replica", cmd_detokenizer, *_service_args(), add_model_args)
    command("frontend", "run a frontend (the public API)", cmd_frontend,
            *_service_args(DEFAULT_PUBLIC_PORT), _scheduler_addresses, add_detokenizer_discovery_args,
            lambda p: add_frontend_args(p, http_port=None), add_model_args)
    sub.add_parser("bench", help="benchmarks: offline, serving, claims, detokenizer (vmesh bench -h)")
    command("health", "exit 0 if a service reports SERVING", cmd_health, _health_args)
    command("certs", "make a private CA and a certificate per role for mutual TLS", cmd_certs, _certs_args)
    command("warm-cache", "convert the model once so later starts are fast", cmd_warm_cache, add_model_args)
    command("generate", "stream a completion from a running mesh", cmd_generate, _generate_args)
    command("chat", "chat with a running mesh", cmd_chat, _client_args, _sampling_args)
    for subparser in sub.choices.values():  # also accepted after the subcommand
        subparser.add_argument("--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING or ERROR")
    return parser


def main(argv: list[str] | None = None) -> int:
    prefer_huge_pages()  # before anything imports torch; the services the launcher starts inherit it
    argv = sys.argv[1:] if argv is None else argv
    rest = argv
    while rest[:1] == ["--log-level"] or (rest and rest[0].startswith("--log-level=")):
        rest = rest[2:] if rest[0] == "--log-level" else rest[1:]
    if rest[:1] == ["bench"]:  # its own parser, in services/bench/
        from vmesh.services.bench.cli import main as bench_main

        return bench_main(rest[1:])
    from vmesh.services.launcher import die_with_launcher
    from vmesh.services.process_priority import take_launcher_priority

    die_with_launcher()
    take_launcher_priority()
    try:
        parser = build_parser()
    except BadEnvironmentValue as exc:
        print(f"vmesh: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import grpc

    try:
        return args.func(args)
    except (ModelLoadError, ValueError) as exc:
        print(f"vmesh: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a service that cannot start (a port taken, say): one line, not a traceback
        print(f"vmesh: error: {exc}", file=sys.stderr)
        return 1
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
