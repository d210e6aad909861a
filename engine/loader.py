"""Model files: resolve a model spec to a Hugging Face folder, read its config, read its weights.

A spec is "default" (the embedded SmolLM2 GGUF), a path to a .gguf file, or a Hugging Face folder.
GGUF files are converted once into the cache and reused:

    cache_dir/models/<name>/hf/             the converted folder (appears atomically, by rename)
    cache_dir/models/<name>/hf/.morphserve-complete   written last: its presence means "complete"
    cache_dir/models/<name>/convert.lock    held while converting, so two replicas convert only once

Weights are read with safetensors' memory-mapped safe_open, one tensor at a time, so asking for a
few layers never reads the whole checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open

from engine.default_model import DEFAULT_MODEL_NAME, default_gguf_path
from engine.cache_lock import exclusive_build
from engine.errors import ModelLoadError
from engine.gguf_convert import convert_gguf, is_complete
from engine.config import default_cache_dir
from engine.model import Transformer, build_model
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    name: str  # served name: the folder's or GGUF file's name, or DEFAULT_MODEL_NAME
    hf_dir: Path  # a complete Hugging Face folder (config.json + safetensors [+ tokenizer])
    source: str  # "default" | "gguf" | "hf"


def resolve_model(spec: str, cache_dir: Path) -> ModelFiles:
    """'default' | path/to/model.gguf | path/to/hf_folder -> ModelFiles (converting GGUF once, cached)."""
    if spec == "default":
        hf_dir = _converted(default_gguf_path(), Path(cache_dir) / "models" / DEFAULT_MODEL_NAME)
        return ModelFiles(DEFAULT_MODEL_NAME, hf_dir, "default")
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {spec!r} does not exist; pass 'default', a Hugging Face folder or a .gguf file")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file; pass a .gguf file or a Hugging Face folder")
        st = path.stat()
        # The key changes when the file is replaced, so a stale conversion is never reused.
        key = f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
        return ModelFiles(path.stem, _converted(path, Path(cache_dir) / "models" / key), "gguf")
    validate_hf_dir(path)
    return ModelFiles(path.resolve().name, path, "hf")


def _converted(gguf_path: Path, model_dir: Path) -> Path:
    hf_dir = model_dir / "hf"
    if is_complete(hf_dir):
        return hf_dir
    with exclusive_build(model_dir, "convert.lock", f"the conversion of {gguf_path}"):
        if not is_complete(hf_dir):  # another process may have finished meanwhile
            # Leftovers: a crashed conversion's temp siblings, a folder of an older converter format.
            shutil.rmtree(hf_dir, ignore_errors=True)
            for stale in model_dir.glob(".hf.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            convert_gguf(gguf_path, hf_dir)
    return hf_dir


def validate_hf_dir(hf_dir: Path) -> None:
    """A usable folder: exists, has a supported config.json and at least one safetensors file."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ModelLoadError(f"model folder {hf_dir} does not exist; pass a Hugging Face model folder")
    load_config(hf_dir)
    _tensor_files(hf_dir)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelLoadError(f"cannot read {path} ({e}); check the file exists and is readable") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); re-download or re-convert the model") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a {type(data).__name__}, not a JSON object; re-download the model")
    return data


def load_config(hf_dir: Path) -> ModelConfig:
    """ModelConfig from config.json; eos ids from generation_config.json are added when present."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{hf_dir} has no config.json; pass a Hugging Face model folder (or a .gguf file)")
    cfg = ModelConfig.from_hf_dict(_read_json(path))
    gen_path = Path(hf_dir) / "generation_config.json"
    if gen_path.is_file():
        eos = _read_json(gen_path).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *(int(e) for e in extra)]))
        cfg = dataclasses.replace(cfg, eos_token_ids=merged)
    return cfg


def _tensor_files(hf_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (sharded via the index, or a single file)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / _INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map; re-download the model")
        return {name: hf_dir / fname for name, fname in weight_map.items()}
    files = [hf_dir / _SINGLE_FILE] if (hf_dir / _SINGLE_FILE).is_file() else sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{hf_dir} has no .safetensors weights; convert .bin checkpoints to safetensors first "
                             f"(MorphServe reads only safetensors)")
    located: dict[str, Path] = {}
    for f in files:
        with _open(f) as handle:
            located.update((name, f) for name in handle.keys())
    return located


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(f"cannot read weights file {path} ({e}); check its permissions, or re-download / "
                             f"re-convert the model (the file is not valid safetensors)") from e


def weight_names(hf_dir: Path) -> list[str]:
    """Every tensor name in the checkpoint, sorted."""
    return sorted(_tensor_files(hf_dir))


def load_weights(hf_dir: Path, dtype: torch.dtype, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors by HF name, cast to dtype; only `names` when given (raises if any is missing)."""
    located = _tensor_files(hf_dir)
    wanted = list(located) if names is None else list(names)
    missing = [n for n in wanted if n not in located]
    if missing:
        raise ModelLoadError(f"{hf_dir} lacks {len(missing)} weight(s), e.g. {missing[:3]}; the checkpoint is "
                             f"incomplete: re-download or re-convert it")
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(located[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        with _open(path) as handle:
            for n in file_names:
                try:
                    out[n] = handle.get_tensor(n).to(dtype)
                except (OSError, SafetensorError) as e:
                    raise ModelLoadError(f"cannot read tensor {n} from {path} ({e}); re-download the model") from e
    return out


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: its files, architecture, weights built on a device, and tokenizer (None
    when the folder has none: then only token-id prompts work and text calibration is impossible)."""
    files: ModelFiles
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer | None


def load_model(spec: str, dtype: torch.dtype, device: torch.device | str = "cpu",
               cache_dir: Path | None = None) -> LoadedModel:
    """The one way to load a model, for the engine and for offline tools (prepare, profiler, quality)."""
    files = resolve_model(spec, cache_dir or default_cache_dir())
    config = load_config(files.hf_dir)
    model = build_model(config, load_weights(files.hf_dir, dtype), dtype, device)
    try:
        tokenizer = Tokenizer.from_dir(files.hf_dir)
    except ModelLoadError as e:
        logger.warning("no usable tokenizer in %s (%s); only token-id prompts will work", files.hf_dir, e)
        tokenizer = None
    return LoadedModel(files, config, model, tokenizer)
