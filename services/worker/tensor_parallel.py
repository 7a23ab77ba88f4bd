"""Tensor parallelism: N worker processes hold one model between them, over torch.distributed.

Each rank holds a slice of every layer (Megatron's split): q/k/v and gate/up by output rows
(column-parallel, whole heads and whole intermediate features per rank), o_proj and down_proj by
input columns (row-parallel: each rank's product is a partial sum, all-reduced), the embedding and
the LM head by vocabulary range. A rank's KV cache holds only its own KV heads; where there are
fewer KV heads than ranks, each KV head is replicated on size / kv_heads ranks (as vLLM does).

The model runs unchanged on the narrower `shard_spec`; `DecoderModel` adds the all-reduces, the
vocab-parallel lookup and the gathering of the logits. Every rank ends a step with the same full
logits and the same random state, so every rank samples the same tokens into its own persistent
batch; the scheduler sends each plan to every rank and uses rank 0's answer.

A group cannot outlive one of its ranks: a torch.distributed group cannot take a restarted member
back. So a rank that sees a peer go (a failed collective, or the heartbeat between steps) exits,
and the whole group restarts and meets again, which the scheduler sees as a worker that died.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from vmesh.services.common.model_spec import ModelSpec
from vmesh.services.worker.config import WorkerConfig

if TYPE_CHECKING:
    from vmesh.services.worker.quantized_linear import QuantizedWeight

logger = logging.getLogger(__name__)

# Ranks meet, then each loads its share of the weights: a slow loader keeps the others waiting
# this long, at most, before they give up.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
# Once loaded, ranks run the same steps in lockstep: a peer that keeps a collective waiting this long
# never got the step (its scheduler stream broke between two writes) and the group is stuck.
STEP_TIMEOUT = timedelta(minutes=2)
# A peer that died is noticed within a heartbeat even while no step runs: otherwise a survivor
# idles in a broken group and its restarted peer can never join it.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
GROUP_FAILED_EXIT_CODE = 1


class TensorParallelError(ValueError):
    """A tensor-parallel size or setting that cannot work."""


def shard_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The shape one rank of `size` computes: its attention heads, KV heads and MLP features.
    vocab_size stays the model's (the logits are gathered whole)."""
    if size < 1:
        raise TensorParallelError(f"tensor parallel size must be at least 1, not {size}")
    if spec.num_heads % size:
        raise TensorParallelError(
            f"tensor parallel size {size} does not divide the model's {spec.num_heads} attention heads "
            f"({spec.num_kv_heads} KV heads)")
    kv = spec.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise TensorParallelError(
            f"tensor parallel size {size} cannot share the model's {kv} KV heads ({spec.num_heads} attention "
            f"heads): it must divide them, or be a multiple of them (each KV head replicated)")
    widths = {spec.intermediate_size} | {layer.mlp.intermediate_size for layer in spec.layers}
    if indivisible := sorted(width for width in widths if width % size):
        raise TensorParallelError(
            f"tensor parallel size {size} does not divide the model's MLP width {', '.join(map(str, indivisible))} "
            "(an expert's MLP is split across the ranks as a dense one is)")
    if vocab_range(spec.vocab_size, size - 1, size)[0] >= spec.vocab_size:
        raise TensorParallelError(
            f"tensor parallel size {size} leaves the last rank none of the model's {spec.vocab_size} token ids")
    layers = tuple(dataclasses.replace(layer, mlp=dataclasses.replace(
        layer.mlp, intermediate_size=layer.mlp.intermediate_size // size)) for layer in spec.layers)
    return spec.with_layers(layers, num_heads=spec.num_heads // size, num_kv_heads=max(1, kv // size),
                            intermediate_size=spec.intermediate_size // size)


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the token ids whose embedding and LM-head rows `rank` holds. Every rank
    but the last holds ceil(vocab / size) rows; the last may hold fewer."""
    width = -(-vocab_size // size)
    start = min(vocab_size, rank * width)
    return start, min(vocab_size, start + width)


def kv_head_range(spec: ModelSpec, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the model's KV heads that `rank` holds (one replicated head when the
    ranks outnumber them). Its query heads are exactly those that read these KV heads."""
    kv = spec.num_kv_heads
    if kv >= size:
        per_rank = kv // size
        return rank * per_rank, (rank + 1) * per_rank
    head = rank // (size // kv)
    return head, head + 1


def shard_weights(tensors: Mapping[str, torch.Tensor | QuantizedWeight], spec: ModelSpec, rank: int,
                  size: int) -> dict[str, torch.Tensor | QuantizedWeight]:
    """`rank`'s slices of the checkpoint's Hugging Face-named tensors (`spec` is the whole model's),
    as views: WeightSource copies each as the model takes it. A row-parallel bias stays with rank 0
    only, so that it is added once to the all-reduced sum."""
    shard_spec(spec, size)  # refuses a size that cannot work
    head_dim = spec.head_dim
    q_heads = spec.num_heads // size
    q_rows = slice(rank * q_heads * head_dim, (rank + 1) * q_heads * head_dim)
    kv_start, kv_end = kv_head_range(spec, rank, size)
    kv_rows = slice(kv_start * head_dim, kv_end * head_dim)

    def mlp_rows(width: int) -> slice:  # this rank's share of an MLP (or an expert's) features
        return slice(rank * (width // size), (rank + 1) * (width // size))

    vocab = slice(*vocab_range(spec.vocab_size, rank, size))
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TensorParallelError(f"tensor parallelism needs plain tensors; {name} is {type(tensor).__name__} "
                                      "(use --weights dequantized)")
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = tensor[vocab]
        elif name.endswith(".experts.gate_up_proj"):  # [experts, gate rows + up rows, hidden]
            half = tensor.shape[1] // 2
            rows = mlp_rows(half)
            out[name] = torch.cat([tensor[:, rows], tensor[:, half:][:, rows]], dim=1)
        elif name.endswith(".experts.down_proj"):  # [experts, hidden, features]: row-parallel
            out[name] = tensor[:, :, mlp_rows(tensor.shape[2])]
        elif module == "q_proj":
            out[name] = tensor[q_rows]
        elif module in ("k_proj", "v_proj"):
            out[name] = tensor[kv_rows]
        elif module in COLUMN_PARALLEL_MLP:
            out[name] = tensor[mlp_rows(tensor.shape[0])]
        elif module in ("o_proj", *ROW_PARALLEL_MLP):
            columns = q_rows if module == "o_proj" else mlp_rows(tensor.shape[-1])
            if kind == "weight":
                out[name] = tensor[:, columns]
            elif rank == 0:
                out[name] = tensor
        else:  # norms: every rank needs them whole
            out[name] = tensor
    return out


# An MLP's (or one expert's) projections by module name: Llama's, and Mixtral's w1/w3 (gate/up), w2 (down).
COLUMN_PARALLEL_MLP = ("gate_proj", "up_proj", "w1", "w3")
ROW_PARALLEL_MLP = ("down_proj", "w2")


def join_group(config: WorkerConfig, spec: ModelSpec, device: torch.device) -> TensorParallel | None:
    """The worker's tensor-parallel group (None for a size of 1), after refusing at once, before
    waiting for any peer, settings that cannot work."""
    if config.tensor_parallel_size == 1:
        return None
    shard_spec(spec, config.tensor_parallel_size)
    if config.weights == "native":
        raise TensorParallelError("tensor parallelism does not shard GGUF blocks kept native: use --weights "
                                  "dequantized with --tensor-parallel-size")
    return TensorParallel.join(config.tensor_parallel_size, config.tensor_parallel_rank, config.tensor_parallel_init,
                               device, spec.vocab_size)


def _loopback_interface() -> str | None:
    for _index, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo0"):
            return name
    return None


def parse_rendezvous(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TensorParallelError(f"--tensor-parallel-init {address!r}: expected host:port, e.g. 127.0.0.1:29500")
    return host.strip("[]"), int(port)


class TensorParallel:
    """This process's place in its group, and the collectives the model needs."""

    def __init__(self, rank: int, size: int, device: torch.device, vocab_size: int):
        self.rank = rank
        self.size = size
        self.device = device
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, rank, size)
        self.vocab_width = -(-vocab_size // size)  # every rank's shard, padded to the widest
        self._heartbeat_group: dist.ProcessGroup | None = None
        self._stopped = threading.Event()

    @classmethod
    def join(cls, size: int, rank: int, init: str, device: torch.device, vocab_size: int) -> TensorParallel:
        """Meet the group's other ranks at `init` (rank 0 listens there): gloo on the CPU, NCCL on CUDA."""
        if not 0 <= rank < size:
            raise TensorParallelError(f"tensor parallel rank {rank} is outside a group of {size}")
        if not init:
            raise TensorParallelError("a tensor-parallel worker needs --tensor-parallel-init host:port "
                                      "(where rank 0 listens), the same for every rank")
        host, port = parse_rendezvous(init)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", rank % torch.cuda.device_count())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        # gloo binds the interface of the host's name unless told; a group meeting on loopback
        # stays on it (nothing listens beyond this machine).
        if _is_loopback(host) and "GLOO_SOCKET_IFNAME" not in os.environ and (lo := _loopback_interface()):
            os.environ["GLOO_SOCKET_IFNAME"] = lo
        logger.info("tensor parallel rank %d of %d: meeting the group at %s (%s)", rank, size, init, backend)
        netloc = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets in a URL
        dist.init_process_group(backend, init_method=f"tcp://{netloc}:{port}", world_size=size, rank=rank,
                                timeout=RENDEZVOUS_TIMEOUT)
        group = cls(rank, size, device, vocab_size)
        group._heartbeat_group = dist.new_group(backend="gloo", timeout=HEARTBEAT_TIMEOUT)
        group._same_random_state()
        threading.Thread(target=group._watch, name="vmesh-tp-heartbeat", daemon=True).start()
        logger.info("tensor parallel group of %d formed", size)
        return group

    def _same_random_state(self) -> None:
        """Unseeded sampling draws from the global generator: every rank seeds it alike so that
        each draws what rank 0 draws (seeded requests have their own generators)."""
        seed = torch.randint(0, 1 << 62, (1,)) if self.rank == 0 else torch.zeros(1, dtype=torch.int64)
        seed = seed.to(self.device)
        self._collective(dist.broadcast, seed, src=0)
        torch.manual_seed(int(seed.item()))

    def agree_loaded(self, kv_cache_budget: int) -> int:
        """Every rank has loaded its weights: agree on the smallest KV cache budget (the scheduler
        requires the ranks' block counts to be equal), then wait for peers only a step's skew."""
        budget = torch.tensor([kv_cache_budget], dtype=torch.int64, device=self.device)
        self._collective(dist.all_reduce, budget, op=dist.ReduceOp.MIN)
        if hasattr(dist.distributed_c10d, "_set_pg_timeout"):  # private; without it, the rendezvous timeout holds
            dist.distributed_c10d._set_pg_timeout(STEP_TIMEOUT)
        return int(budget.item())

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `partial` (a row-parallel product), identical on every rank.
        bfloat16 partials add in float32 and round once."""
        summed = partial.float() if partial.dtype == torch.bfloat16 else partial
        self._collective(dist.all_reduce, summed)
        return summed.to(partial.dtype)

    def local_token_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids as rows of this rank's embedding slice; ids it does not hold read row 0,
        which `reduce_embedding` then zeroes."""
        local = input_ids - self.vocab_start
        return local.masked_fill((local < 0) | (input_ids >= self.vocab_end), 0)

    def reduce_embedding(self, rows: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's row comes from the one rank holding it: the others add zeros."""
        foreign = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        return self.all_reduce(rows.masked_fill(foreign.unsqueeze(-1), 0))

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's logits for its vocabulary slice, joined into the full rows on every rank."""
        if local.shape[-1] < self.vocab_width:  # the last slice may be narrower; gather wants equal ones
            local = torch.nn.functional.pad(local, (0, self.vocab_width - local.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self._collective(dist.all_gather, parts, local.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def _collective(self, collective: Callable[..., object], /, *args: object, **kwargs: object) -> None:
        try:
            collective(*args, **kwargs)
        except RuntimeError as exc:  # a peer died or timed out: the group is gone for good
            if self._stopped.is_set():
                raise  # leaving: peers go too, and the step's stream is closing anyway
            self.fail(f"{getattr(collective, '__name__', collective)} failed: {exc}")

    def _watch(self) -> None:
        while not self._stopped.wait(HEARTBEAT_INTERVAL_S):
            try:
                dist.monitored_barrier(group=self._heartbeat_group, timeout=HEARTBEAT_TIMEOUT)
            except RuntimeError as exc:
                if self._stopped.is_set():
                    return
                self.fail(f"heartbeat failed: {exc}")

    def fail(self, reason: str) -> NoReturn:
        logger.critical("tensor parallel rank %d of %d: the group is broken (%s); exiting so that every rank "
                        "restarts and the group meets again", self.rank, self.size, reason)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(GROUP_FAILED_EXIT_CODE)

    def leave(self) -> None:
        """This rank is stopping (SIGTERM, with its peers): their exits are no longer failures."""
        self._stopped.set()

    def close(self) -> None:
        """Leave the group together (tests; a serving worker leaves by exiting): past the barrier
        a peer's exit is expected, not a failure. The caller then exits with os._exit, as a
        worker does: the heartbeat thread may still be inside a barrier its peers never join."""
        self._stopped.set()
        self._collective(dist.barrier)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
