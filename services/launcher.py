"""`vmesh serve`: every service as its own OS process on loopback, started in dependency order, each waited
on until healthy; one public address printed; everything stopped together on Ctrl-C / SIGTERM. A service that
dies once the mesh serves is restarted in place (same address, backoff between attempts) and its peers fail its
requests over; with --fail-fast, or during start-up, a death stops the whole mesh instead, naming the culprit."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vmesh.services.common import tls
from vmesh.services.common.grpc_server import DRAIN_GRACE_S, STOP_GRACE_S, wait_until_serving
from vmesh.services.common.runtime.readiness import Announcement, ReadyFiles
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.flag_groups import forwarded_flags, forwarded_secrets
from vmesh.services.mesh_description import FrontendEntry, MeshDescription, ServiceEntry
from vmesh.services.mesh_settings import mesh_settings
from vmesh.services.process_priority import niceness_env

INTERNAL_HOST = "127.0.0.1"
START_TIMEOUT_S = 900.0  # the first start converts the model
# A service's drain and stop, and a margin (killed sooner, its clients see a cut connection).
STOP_TIMEOUT_S = DRAIN_GRACE_S + STOP_GRACE_S + 5.0
PARENT_PID_ENV = "VMESH_LAUNCHER_PID"
RESTART_BACKOFF_S = 0.5  # before the first restart; doubled for each death soon after a restart
RESTART_BACKOFF_MAX_S = 10.0
RESTART_BACKOFF = Backoff(RESTART_BACKOFF_S, factor=2.0, max_s=RESTART_BACKOFF_MAX_S)
STABLE_AFTER_S = 30.0  # a service that lived this long starts again from the first backoff
SUPERVISE_INTERVAL_S = 0.2


@dataclass
class Child:
    name: str
    service: str  # its role: worker, scheduler, detokenizer or frontend
    process: subprocess.Popen
    ready_file: Path
    argv: list[str]  # its service's own flags (what a restart gives it again)
    host: str
    env: dict[str, str]
    address: str = ""
    metrics_address: str = ""
    http_address: str = ""  # the frontend's OpenAI-compatible API, when on
    health_address: str = ""  # its plaintext health-only port, when it has one (the frontend)
    restarts: int = 0
    quick_deaths: int = 0  # deaths in a row, each soon after it served: the backoff's exponent
    serving_since: float | None = None  # monotonic; None until it serves
    restarting: bool = False  # a restart task owns it
    backoff: Backoff = RESTART_BACKOFF
    # The other ranks of its tensor-parallel group: a group cannot take one rank back, so when one
    # dies they all start again together.
    siblings: list[Child] = field(default_factory=list)

    def restart_delay(self) -> float:
        """It died: the wait before starting it again, which doubles while it keeps dying before
        it has served STABLE_AFTER_S (model loading does not count)."""
        lived = 0.0 if self.serving_since is None else time.monotonic() - self.serving_since
        self.quick_deaths = 0 if lived > STABLE_AFTER_S else self.quick_deaths + 1
        return self.backoff.delay(self.quick_deaths)

    def check_alive(self) -> None:
        if (code := self.process.poll()) is not None:
            raise ChildDied(f"{self.name} (pid {self.process.pid}) exited with code {code}")

    def restart_argv(self) -> list[str]:
        """Its flags again, with every port it was given at first (0: any) replaced by the one it
        bound: peers, probes and scrapers know it by them."""
        argv = list(self.argv)
        for flag, address in (("--port", self.address), ("--http-port", self.http_address),
                              ("--metrics-port", self.metrics_address), ("--health-port", self.health_address)):
            if address and flag in argv:
                argv[argv.index(flag) + 1] = address.rpartition(":")[2]
        return argv


class Mesh:
    def __init__(self, args: argparse.Namespace, workdir: Path, restart_backoff: Backoff = RESTART_BACKOFF):
        self.args = args
        self.restart_backoff = restart_backoff
        self.workdir = workdir
        self.children: list[Child] = []
        self.certificates: Path | None = None  # unless --no-internal-tls: ca.crt and <role>.crt/.key
        self.identity: tls.Identity | None = None  # unless --no-internal-tls: the admin's, for its health checks
        self.start_deadline = time.monotonic() + START_TIMEOUT_S
        self.stop_requested = False

    def start(self, name: str, service: str, argv: list[str], host: str = INTERNAL_HOST, port: int = 0,
              env: dict[str, str] | None = None) -> Child:
        # The launcher's own VMESH_* settings reach a child as the flags of its group, never by inheritance:
        # a VMESH_HEALTH_PORT or VMESH_TLS_CERT meant for one service must not land on all of them.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("VMESH_")}
        niceness = niceness_env(service, mesh_settings(self.args).service_niceness)
        env = {**inherited, **(env or {}), **niceness, PARENT_PID_ENV: str(os.getpid())}
        ready = self.workdir / f"{name}.addr"
        argv = ["--host", host, "--port", str(port), *argv]
        if self.args.metrics:
            argv += ["--metrics-port", "0"]
        if service == "frontend":  # its port is the public one: probed on a plaintext health port
            argv += ["--health-port", "0"]
        if self.certificates is not None:
            argv += ["--tls-cert", str(self.certificates / f"{service}.crt"),
                     "--tls-key", str(self.certificates / f"{service}.key"),
                     "--tls-ca", str(self.certificates / "ca.crt")]
        child = Child(name, service, self._spawn(service, argv, ready, env), ready, argv, host, env,
                      backoff=self.restart_backoff)
        self.children.append(child)
        return child

    def _spawn(self, service: str, argv: list[str], ready: Path, env: dict[str, str]) -> subprocess.Popen:
        command = [sys.executable, "-m", "vmesh", "--log-level", self.args.log_level, service,
                   "--ready-file", str(ready), *argv]
        # No preexec_fn: forking with one runs Python in the child and gRPC's fork handlers in
        # this (multi-threaded, gRPC-using) process. The child asks for its death signal and priority itself.
        return subprocess.Popen(command, env=env)

    async def wait_ready(self, children: list[Child]) -> None:
        """Every child serving before the mesh's start deadline (START_TIMEOUT_S for the whole
        start, not per wait), or ChildDied/StartTimeout; a dead child or a stop request ends the
        wait at once."""
        deadline = self.start_deadline
        waiting = asyncio.gather(*(self._serving(c, deadline) for c in children))
        try:
            while not waiting.done():
                self.check_alive()
                if time.monotonic() > deadline:
                    late = ", ".join(c.name for c in children if not c.address) or "a health check"
                    raise StartTimeout(f"{late} not serving within {START_TIMEOUT_S:.0f} s")
                await asyncio.wait({waiting}, timeout=0.1)
            waiting.result()
        except TimeoutError as exc:
            raise StartTimeout(str(exc)) from exc
        finally:
            waiting.cancel()

    async def _serving(self, child: Child, deadline: float) -> None:
        """Wait for `child` to write its ready file and answer health checks (it writes the file
        before it loads anything); then read the addresses it bound. ChildDied as soon as it
        exits meanwhile."""
        ready = ReadyFiles(child.ready_file)
        while (address := ready.read()) is None:
            child.check_alive()
            await asyncio.sleep(0.1)
        child.address = address
        child.health_address = ready.read(Announcement.HEALTH) or ""
        remaining = max(1.0, deadline - time.monotonic())
        if child.health_address:
            healthy = asyncio.ensure_future(wait_until_serving(child.health_address, remaining, secure=False))
        else:
            healthy = asyncio.ensure_future(wait_until_serving(child.address, remaining, child.service,
                                                               identity=self.identity))
        try:
            while not healthy.done():
                child.check_alive()
                await asyncio.wait({healthy}, timeout=0.1)
            healthy.result()
        finally:
            healthy.cancel()
        child.serving_since = time.monotonic()
        child.metrics_address = ready.read(Announcement.METRICS) or ""
        child.http_address = ready.read(Announcement.HTTP) or ""

    async def supervise(self, on_change: Callable[[], None]) -> None:
        """Until a stop request: restart each child that dies (or, with --fail-fast, raise
        ChildDied). `on_change`: a restarted child serves again (its pid, its count changed)."""
        restarts: set[asyncio.Task] = set()
        while True:
            if self.stop_requested:
                raise StopRequested
            for child in self.children:
                if child.restarting or (code := child.process.poll()) is None:
                    continue
                if self.args.fail_fast:
                    child.check_alive()
                for sibling in child.siblings:
                    if sibling.process.poll() is None and not sibling.restarting:
                        sibling.process.kill()  # restarted below, or on the next tick
                child.restarting = True
                task = asyncio.create_task(self._restart(child, code, on_change))
                restarts.add(task)
                task.add_done_callback(restarts.discard)
            await asyncio.sleep(SUPERVISE_INTERVAL_S)

    async def _restart(self, child: Child, code: int, on_change: Callable[[], None]) -> None:
        """Start a dead child again on its address, after a backoff that grows while it keeps
        dying soon after starting."""
        delay = child.restart_delay()
        served = "" if child.serving_since is None else \
            f" after serving {time.monotonic() - child.serving_since:.1f} s"
        print(f"vmesh: {child.name} (pid {child.process.pid}) exited with code {code}{served}; "
              f"restarting it in {delay:.1f} s (restart {child.restarts + 1})", file=sys.stderr, flush=True)
        try:
            await asyncio.sleep(delay)
            ReadyFiles(child.ready_file).clear()
            child.serving_since = None
            child.process = self._spawn(child.service, child.restart_argv(), child.ready_file, child.env)
            child.restarts += 1
            await self._serving(child, time.monotonic() + START_TIMEOUT_S)
            print(f"vmesh: {child.name} restarted (pid {child.process.pid}, restart {child.restarts})",
                  file=sys.stderr, flush=True)
            on_change()
        except (ChildDied, TimeoutError) as exc:  # the supervisor sees it dead and tries again
            print(f"vmesh: {child.name} did not come back: {exc}", file=sys.stderr, flush=True)
            if child.process.poll() is None:
                child.process.kill()
        finally:
            child.restarting = False

    def check_alive(self) -> None:
        if self.stop_requested:
            raise StopRequested
        for child in self.children:
            child.check_alive()

    def stop(self) -> None:
        """Frontend first, so no new work arrives; then the rest drain and exit. A second
        SIGTERM or Ctrl-C while draining kills what is left."""
        def force(*_: object) -> None:
            for c in self.children:
                if c.process.poll() is None:
                    c.process.kill()

        signal.signal(signal.SIGTERM, force)
        signal.signal(signal.SIGINT, force)
        for child in reversed(self.children):
            if child.process.poll() is None:
                # A tensor-parallel group stops together: a rank that saw a peer leave first would
                # take it for a broken group.
                for rank in (child, *child.siblings):
                    if rank.process.poll() is None:
                        rank.process.send_signal(signal.SIGTERM)
                try:
                    child.process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()


class ChildDied(RuntimeError):
    pass


class StartTimeout(RuntimeError):
    pass


class StopRequested(Exception):
    pass


def die_with_launcher() -> None:
    """In a service started by `vmesh serve`: ask Linux for SIGTERM when the launcher dies,
    however it dies, so that no service outlives it. Exits at once if it is already gone.

    Ctrl-C in a terminal signals the whole foreground process group, the services with the
    launcher: each would drain at once, the worker before the requests it serves. The launcher
    stops them in order (frontend first) instead, so a service it started ignores SIGINT
    (ServiceShell keeps an ignored SIGINT ignored)."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the request took effect
        sys.exit(1)


def _make_certificates(mesh: Mesh) -> None:
    """A private CA for this run, a certificate per role; the launcher itself is the admin."""
    from vmesh.services.common.certs import write_mesh_certificates

    mesh.certificates = write_mesh_certificates(mesh.workdir / "certs")
    mesh.identity = MeshDescription(address="", certificates=str(mesh.certificates)).admin_identity()


async def _run(mesh: Mesh) -> int:
    args = mesh.args
    if mesh_settings(args).internal_tls:
        _make_certificates(mesh)
    model = forwarded_flags(args, "model")
    groups = args.data_parallel_size
    suffixes = [""] if groups == 1 else [f"-{g}" for g in range(groups)]  # one worker group: plain names
    workers = [_start_worker_group(mesh, f"worker{x}", model + forwarded_flags(args, "worker"), group)
               for group, x in enumerate(suffixes)]
    detokenizers = [mesh.start(f"detokenizer-{i}", "detokenizer", model) for i in range(args.detokenizers)]
    await mesh.wait_ready([*(rank for ranks in workers for rank in ranks), *detokenizers])
    detok_addresses = ",".join(d.address for d in detokenizers)
    schedulers = [mesh.start(f"scheduler{x}", "scheduler", ["--workers", ",".join(r.address for r in ranks),
                                                             "--detokenizer-addresses", detok_addresses,
                                                             *forwarded_flags(args, "scheduler")])
                  for x, ranks in zip(suffixes, workers)]
    await mesh.wait_ready(schedulers)
    frontend_argv = ["--scheduler", ",".join(s.address for s in schedulers), "--detokenizer-addresses",
                     detok_addresses, *model, *forwarded_flags(args, "frontend")]
    frontends = [mesh.start(name, "frontend", argv, host=args.host, port=port, env=forwarded_secrets(args, "frontend"))
                 for name, argv, port in _frontends(frontend_argv, mesh_settings(args).frontends, args.port)]
    await mesh.wait_ready(frontends)
    frontend = frontends[0]
    description = _describe(mesh, frontend)
    for name, entry in description.services.items():
        metrics = f", metrics {entry.metrics_url}" if entry.metrics_url else ""
        print(f"vmesh: {name} at {entry.address} (pid {entry.pid}{metrics})", flush=True)
    if description.http_url:
        url = description.http_url
        keyed = getattr(args, "api_key", None) or os.environ.get("VMESH_API_KEY")
        header = "-H 'Authorization: Bearer <your API key>' " if keyed else ""
        print(f"vmesh: OpenAI-compatible HTTP API on {url} — try: curl {header}{url}/models", flush=True)
    if description.certificates:
        print(f"vmesh: internal mutual TLS; CA and admin certificate in {description.certificates}", flush=True)
    print(f"vmesh: serving on {frontend.address} — try: vmesh generate \"Hello\" --address {frontend.address}",
          flush=True)
    def describe() -> None:
        if args.ready_file:
            ReadyFiles(args.ready_file).write(Announcement.MESH_DESCRIPTION, _describe(mesh, frontend).to_json())

    # The description first: whoever sees the ready file finds the description complete.
    describe()
    if args.ready_file:
        ReadyFiles(args.ready_file).write(Announcement.ADDRESS, frontend.address)
    await mesh.supervise(on_change=describe)  # until a signal (or, with --fail-fast, a dead child)
    return 0


def _frontends(argv: list[str], count: int, port: int) -> list[tuple[str, list[str], int]]:
    """Each frontend's name, flags and port: the first on the given ports, the others on free ones."""
    others = list(argv)
    if "--http-port" in others:
        others[others.index("--http-port") + 1] = "0"
    return [("frontend", argv, port), *((f"frontend-{i}", others, 0) for i in range(1, count))]


def worker_threads(cores: int, workers: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment that gives each of `workers` worker processes on this machine its share of
    the cores: several workers (tensor-parallel ranks, data-parallel groups) whose OpenMP teams each
    took every core would spin against each other at every step. Nothing for a lone worker, or
    when the operator set OMP_NUM_THREADS."""
    if workers <= 1 or "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, cores // workers))}


def _start_worker_group(mesh: Mesh, name: str, argv: list[str], group: int = 0) -> list[Child]:
    """One worker, or with --tensor-parallel-size N the N ranks that share its model (named
    `<name>-rank<R>`), meeting at a rendezvous address of their own. On a GPU machine rank R of
    data-parallel group G sees only GPU G * N + R (unless CUDA_VISIBLE_DEVICES is set already):
    groups must not share GPUs, and NCCL refuses two ranks on one."""
    size = mesh.args.tensor_parallel_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = worker_threads(cores, size * mesh.args.data_parallel_size, os.environ)
    if size == 1:
        return [mesh.start(name, "worker", argv, env=threads)]
    rendezvous = f"{INTERNAL_HOST}:{free_port()}"

    def env(rank: int) -> dict[str, str]:
        gpu = {} if "CUDA_VISIBLE_DEVICES" in os.environ else {"CUDA_VISIBLE_DEVICES": str(group * size + rank)}
        return {**threads, **gpu}

    ranks = [mesh.start(f"{name}-rank{rank}", "worker", [*argv, "--tensor-parallel-rank", str(rank),
                                                         "--tensor-parallel-init", rendezvous], env=env(rank))
             for rank in range(size)]
    for rank in ranks:
        rank.siblings = [other for other in ranks if other is not rank]
    return ranks


def free_port() -> int:
    """A loopback port nobody holds now (for a peer that cannot bind port 0 and report it)."""
    with socket.socket() as probe:
        probe.bind((INTERNAL_HOST, 0))
        return probe.getsockname()[1]


def _http_url(mesh: Mesh, frontend: Child) -> str:
    if not frontend.http_address:
        return ""
    return f"{'https' if mesh.args.public_tls_cert else 'http'}://{frontend.http_address}/v1"


def _describe(mesh: Mesh, frontend: Child) -> MeshDescription:
    http_url = _http_url(mesh, frontend)
    frontends = [c for c in mesh.children if c.service == "frontend"]
    return MeshDescription(
        address=frontend.address, http_url=http_url,
        frontends=[FrontendEntry(c.address, _http_url(mesh, c)) for c in frontends],
        certificates=str(mesh.certificates) if mesh.certificates is not None else "",
        services={c.name: ServiceEntry(c.address, c.process.pid,
                                       f"http://{c.metrics_address}/metrics" if c.metrics_address else "",
                                       c.restarts)
                  for c in mesh.children})


def serve_mesh(args: argparse.Namespace) -> int:
    for flag in ("detokenizers", "frontends", "data_parallel_size", "tensor_parallel_size"):
        if getattr(args, flag) < 1:
            print(f"vmesh: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.ready_file:  # a previous run's answer must not read as this run's
        ReadyFiles(args.ready_file).clear()
    with tempfile.TemporaryDirectory(prefix="vmesh-") as tmp:
        mesh = Mesh(args, Path(tmp))

        def request_stop(*_: object) -> None:
            mesh.stop_requested = True

        # Plain handlers rather than the event loop's: they stay installed from start-up until
        # Mesh.stop replaces them, so no signal ever finds the default (kill at once) action.
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

        try:
            return asyncio.run(_run(mesh))
        except StopRequested:
            return 0
        except (ChildDied, StartTimeout) as exc:
            print(f"vmesh: {exc}; stopping the mesh", file=sys.stderr, flush=True)
            return 1
        finally:
            mesh.stop()
            if args.ready_file:
                ReadyFiles(args.ready_file).clear()
