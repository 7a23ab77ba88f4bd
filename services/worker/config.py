"""The worker's settings: each default, flag, VMESH_* variable and help text written once here
(services/common/config_flags.py derives the command line from them). Free of torch, so that
services without a model can still build the command line."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vmesh.services.common.config_flags import setting
from vmesh.services.speculative.config import (
    SpeculativeConfig,
    checked_speculative_config,
    parse_speculative_config,
)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_memory_size(text: str | int) -> int:
    """'2GiB', '512M', '1.5gb' or a plain byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {text!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


KV_CACHE_DTYPES = ["auto", "int8"]
# The model dtypes a worker runs (torch's names for them: services/worker/model_runner.py maps them).
DTYPE_NAMES = ("float32", "float16", "bfloat16")


def _memory_size_or_none(text: str) -> int | None:
    return parse_memory_size(text) if text else None


@dataclass
class WorkerConfig:
    # The model section: also given to the detokenizers and the frontend, for the tokenizer.
    model: str | None = setting(  # None: the embedded default model
        None, section="model",
        help="Hugging Face directory or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    cache_dir: str | None = setting(  # its variable, VMESH_CACHE_DIR, is model_loading's CACHE_DIR_ENV
        None, section="model", help="where converted GGUF models are cached (default ~/.cache/vmesh)")
    # The frontend's and the in-process engine's (services/common/tokenizer.py, chat_template_text).
    chat_template: str | None = setting(
        None, section="model",
        help="a Jinja chat template, or a file holding one, in place of the model's (default: the model's own, else "
             "its architecture's turn format, e.g. Gemma 3's)")

    device: str = setting("auto", section="worker", help="cpu, cuda, cuda:N or auto")
    # bfloat16 on CPU: bfloat16 weights, linears and KV cache, float32 residual stream, norms and
    # attention sums (services/worker/model.py).
    dtype: str = setting("float32", section="worker", choices=DTYPE_NAMES,
                         help="the model's dtype (CPU: bfloat16 weights and KV cache, float32 residual stream and "
                              "attention arithmetic)")
    # native: linears keep a GGUF file's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks (services/worker/quantized_linear.py);
    # int8: every linear quantized to int8 at load (services/worker/int8_linear.py).
    weights: str = setting(
        "dequantized", section="worker", choices=["dequantized", "native", "int8"],
        help="dequantized (float32 weights; GGUF files expanded), native (GGUF models on the CPU: linears "
             "multiply the file's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks directly, on int8 dot products where the "
             "CPU has AVX-512 VNNI; other formats are dequantized) or int8 (any model on a CPU with AVX-512 VNNI, "
             "with --dtype float32 or bfloat16: int8 weights per output feature; activations rounded to 16 bits per "
             "token below 8 rows, to 8 bits per block of 64 inputs from 8 rows where the width divides by 64)")
    block_size: int = setting(16, section="worker")
    # int8: vmesh/kernels/cpu/kv_int8.h's rows (codes and a float32 scale per token and KV head).
    kv_cache_dtype: str = setting(
        "auto", section="worker", choices=KV_CACHE_DTYPES,
        help="auto (the model's dtype) or int8 (the CPU only: keys and values rounded to 8 bits per token and KV "
             "head, each row with its own scale: 0.53x of a bfloat16 cache's bytes at head size 64, so 1.9x the "
             "tokens in the same --kv-cache-memory, and faster decode attention)")
    kv_cache_memory: int | None = setting(  # bytes; None: default budget for the device
        None, section="worker", parse_flag=str, to_field=_memory_size_or_none,
        help="KV cache budget, e.g. 2GiB (default: 1GiB on CPU, a fraction of free memory on CUDA)")
    kv_cache_memory_fraction: float = setting(
        0.9, section="worker", help="on CUDA without --kv-cache-memory: fraction of free memory for the KV cache")
    max_num_seqs: int = setting(256, section="worker")
    max_model_len: int | None = setting(  # None: the model's own context length
        None, section="worker", parse_flag=int)
    attention_backend: str = setting("auto", section="worker", choices=["auto", "cpu", "torch", "triton"])
    # CPU, float32 or bfloat16: 1-6 row linears through vmesh/kernels/cpu (faster single streams), and
    # bfloat16 ones of 7-32 rows on AVX-512 BF16 (services/worker/linear.py). They read oneDNN's packed
    # copy where its layout is the known one (AVX-512), else float32 keeps a plain copy and bfloat16
    # leaves those rows to oneDNN.
    small_batch_linear: bool = setting(
        True, section="worker", flag="--no-small-batch-linear", negated=True,
        help="CPU: skip the C linear kernels for 1-6 rows (and bfloat16's for 7-32); oneDNN serves every "
             "batch size")
    # Tensor parallelism (services/worker/tensor_parallel.py): this many worker processes, each started
    # with its own rank and the same rendezvous address, hold one model between them.
    tensor_parallel_size: int = setting(
        1, section="worker", help="worker processes that share one model (tensor parallelism): start each with "
                                  "its own --tensor-parallel-rank and the same --tensor-parallel-init")
    tensor_parallel_rank: int = setting(0, section="worker", help="this process's rank in its tensor-parallel group")
    tensor_parallel_init: str = setting(
        "", section="worker", help="host:port where rank 0 listens for its group's rendezvous (tensor parallelism)")
    # LoRA adapters (services/worker/lora.py): PEFT directories, several per batch.
    enable_lora: bool = setting(False, section="worker",
                                help="serve LoRA adapters (on by itself when --lora-modules names some)")
    lora_modules: list[str] = setting(
        [], section="worker", help="LoRA adapters to load at start, name=path (comma-separated): requests choose one "
                                   "by its name as their model")
    max_loras: int = setting(4, section="worker", help="LoRA adapters resident at once (a batch uses at most this "
                                                       "many; the others wait in host memory)")
    max_lora_rank: int = setting(16, section="worker", help="the largest LoRA rank an adapter may have")


    # Speculative decoding without a draft model (services/speculative/): the JSON object vLLM takes.
    speculative_config: SpeculativeConfig | None = setting(
        None, section="worker", parse_flag=checked_speculative_config, to_field=parse_speculative_config,
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
             '"prompt_lookup_max": 5}\' (method ngram or suffix; also disable_by_batch_size, '
             'suffix_decoding_max_tree_depth, suffix_decoding_max_spec_factor, and '
             'suffix_decoding_max_cached_requests: the suffix method also matches that many recent '
             'requests\' outputs); default: off')

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as {name: path}."""
        return parse_lora_modules(self.lora_modules)


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """name=path items (vLLM's --lora-modules form) -> {name: path}, refusing a malformed or repeated name."""
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {item!r}: expected name=path")
        if name.strip() in modules:
            raise ValueError(f"--lora-modules names {name.strip()!r} twice")
        modules[name.strip()] = path.strip()
    return modules


# Settings that differ between the worker processes of one tensor-parallel group: `vmesh serve`
# sets them per rank instead of taking them as flags.
PER_WORKER_PROCESS = ("tensor_parallel_rank", "tensor_parallel_init")
