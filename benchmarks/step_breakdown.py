"""Where a model runner's step goes, op by op: a timer around every op the step calls.

`instrument(runner)` wraps, in place, the runner's parts (input preparation, sampling, the
bookkeeping after it), the model's (embedding lookup, rotary tables, each layer's linears by
kind, norms, SiLU, rotary + KV write, attention, the LM head) and, one level down, every C
kernel call (the ctypes function itself, so that the Python around a kernel shows apart from the
kernel). What no timer covers inside the model's forward is the Python between ops. Each timer
costs about a microsecond of its own; `Breakdown.report` states how many calls a step makes so
that the reader can weigh that.

Used by benchmarks/decode_step.py --breakdown.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vmesh.services.worker.model_runner import ModelRunner
from vmesh.services.worker.quantized_linear import QuantizedLinear


class Breakdown:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps = 0

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += self.clock() - started
                self.calls[name] += 1

        return wrapper

    def timed_layer(self, name: str, layer: Any) -> Any:
        """`layer` with its calls timed and its attributes (weight_rows, ...) as they were. A
        QuantizedLinear stays itself (the model fuses ops into it only then): its product is timed,
        the ops it takes in (after_rms_norm, after_silu_and_mul) under their own names."""
        if type(layer) is QuantizedLinear and hasattr(layer, "_product"):  # (a baseline tree's may predate it)
            product = layer._product
            timed = _TimedLayer(product, self.timed(name, product.__call__))
            # Set on the wrapper: __getattr__ would hand out the untimed ones.
            timed.after_rms_norm = self.timed(f"{name} (+rms_norm)", product.after_rms_norm)  # type: ignore[attr-defined]
            timed.after_silu_and_mul = self.timed(  # type: ignore[attr-defined]
                f"{name} (+silu_and_mul)", product.after_silu_and_mul)
            layer._product = timed
            return layer
        return _TimedLayer(layer, self.timed(name, layer.__call__))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.steps = 0

    def report(self) -> str:
        """Milliseconds per step by op, the model's ops with their C kernels' share, and the
        remainders: Python between the model's ops, and the runner's own."""
        steps = max(self.steps, 1)
        per_step = {name: seconds / steps * 1e3 for name, seconds in self.seconds.items()}
        model_ops = [name for name in per_step if name.startswith("model/")]
        kernels = [name for name in per_step if name.startswith("C/")]
        runner_ops = [name for name in per_step if name.startswith("runner/") and name != "runner/execute"]
        total, forward = per_step.get("runner/execute", 0.0), per_step.get("runner/forward", 0.0)
        lines = [f"{'op':34s} {'ms/step':>8s} {'calls':>6s} {'us/call':>8s}"]

        def line(name: str, ms: float, calls: int | None = None) -> None:
            count = self.calls.get(name, 0) / steps if calls is None else calls
            per_call = f"{ms / count * 1e3:8.1f}" if count else " " * 8
            lines.append(f"{name:34s} {ms:8.3f} {count:6.0f} {per_call}")

        line("step (runner.execute)", total, 1)
        for name in sorted(runner_ops, key=lambda n: -per_step[n]):
            line(name, per_step[name])
        line("runner/other (Python)", total - sum(per_step[n] for n in runner_ops), 0)
        lines.append("-- inside runner/forward:")
        for name in sorted(model_ops, key=lambda n: -per_step[n]):
            line(name, per_step[name])
        line("model/between ops (Python)", forward - sum(per_step[n] for n in model_ops), 0)
        lines.append("-- C kernels (inside the ops above):")
        for name in sorted(kernels, key=lambda n: -per_step[n]):
            line(name, per_step[name])
        kernel_ms = sum(per_step[n] for n in kernels)
        lines.append(f"C kernels in all: {kernel_ms:.3f} ms of the step's {total:.3f} ms; the rest is Python, torch "
                     f"and ctypes ({total - kernel_ms:.3f} ms)")
        return "\n".join(lines)


def instrument(runner: ModelRunner, breakdown: Breakdown) -> None:
    """Wrap the runner's and its model's ops in `breakdown`'s timers (in place, for good)."""
    timed = breakdown.timed
    model = runner.model
    kernel_sets = {id(k): k for k in _kernel_sets(runner)}  # before the layers are wrapped
    execute = runner.execute

    def counted_execute(plan: Any) -> Any:
        breakdown.steps += 1
        return execute(plan)

    runner.execute = timed("runner/execute", counted_execute)  # type: ignore[method-assign]
    # The one-call decoder stack (services/worker/decoder_stack.py) hides its ops from the timers:
    # the breakdown runs the layers one by one, which is slower at small batches by the dispatch
    # that the stack saves (compare the step's time without --breakdown).
    if hasattr(model, "decoder_stack_enabled"):
        model.decoder_stack_enabled = False
    runner._forward = timed("runner/forward", runner._forward)  # type: ignore[method-assign]
    runner.batch.prepare_inputs = timed("runner/prepare_inputs", runner.batch.prepare_inputs)  # type: ignore
    runner.batch.finish_step = timed("runner/finish_step", runner.batch.finish_step)  # type: ignore
    runner._sampling_batch = timed("runner/sampling_batch", runner._sampling_batch)  # type: ignore
    runner.sampler = timed("runner/sampler", runner.sampler)  # type: ignore[assignment]
    runner._result = timed("runner/result", runner._result)  # type: ignore[method-assign]
    model.embed_tokens = timed("model/embedding", model.embed_tokens)  # type: ignore[method-assign]
    for rotary in model.rotaries.values():
        rotary.tables = timed("model/rotary tables", rotary.tables)  # type: ignore[method-assign]
    model.lm_head = breakdown.timed_layer("model/linear lm_head", model.lm_head)  # type: ignore[assignment]
    for layer in model.layers:
        layer.qkv_proj = breakdown.timed_layer("model/linear qkv", layer.qkv_proj)  # type: ignore[assignment]
        layer.o_proj = breakdown.timed_layer("model/linear o", layer.o_proj)  # type: ignore[assignment]
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):
            mlp.gate_up_proj = breakdown.timed_layer("model/linear gate_up", mlp.gate_up_proj)
            mlp.down_proj = breakdown.timed_layer("model/linear down", mlp.down_proj)
    fused_ops = model.fused_ops

    def timed_ops(backend: Any) -> Any:
        ops = fused_ops(backend)
        return replace(ops, rms_norm=timed("model/rms_norm (+add)", ops.rms_norm),
                       silu_and_mul=timed("model/silu_and_mul", ops.silu_and_mul),
                       rotary_write_kv=None if ops.rotary_write_kv is None
                       else timed("model/rotary + KV write", ops.rotary_write_kv))

    model.fused_ops = timed_ops  # type: ignore[method-assign]
    runner.backend.attend = timed("model/attention", runner.backend.attend)  # type: ignore[method-assign]
    if hasattr(runner.backend, "write_kv"):
        runner.backend.write_kv = timed("model/write_kv", runner.backend.write_kv)  # type: ignore[method-assign]
    # One level down: the C functions (each CpuKernels holds its bound ctypes functions by name).
    for kernels in kernel_sets.values():
        for name, fn in list(kernels._functions.items()):
            kernels._functions[name] = timed(f"C/{name}", fn)


class _TimedLayer:
    def __init__(self, layer: Any, timed_call: Callable[..., Any]):
        self._layer, self._timed_call = layer, timed_call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed_call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def _kernel_sets(runner: ModelRunner) -> list[Any]:
    found = [getattr(runner.backend, "kernels", None), getattr(runner.sampler, "cpu_kernels", None)]
    for layer in runner.model.linears():
        found.append(getattr(layer, "kernels", None))
        found.append(getattr(layer, "_small_batch", None))
    return [k for k in found if k is not None and hasattr(k, "_functions")]
