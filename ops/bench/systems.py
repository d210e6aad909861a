"""The systems under test, the shared memory budget, and how each one is started and observed.

Every system serves the same Hugging Face folder (the default model's, from engine.loader) on
127.0.0.1 under one memory budget B = weights + activation reserve + KV, in bf16 (MorphServe in
fp32 with `--dtype fp32`, or `auto` on a CPU without native bf16; vLLM always in its bf16 default). MorphServe gets
B as its `memory_budget`; vLLM gets the same KV bytes (B - weights - reserve) through
`--kv-cache-memory-bytes`, because VLLM_CPU_KVCACHE_SPACE counts whole GiB and would round our
tens of MiB of KV up to 1 GiB (see `vllm_env`).

Pure parts (specs, command lines, budget arithmetic, the interleaving schedule, status parsing) live
here and are unit-tested; starting and stopping processes lives in server_process.py.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from ops.bench import BenchmarkInputError
from ops.bench.loadgen import parse_json_status, prometheus_status_parser

DTYPE_BYTES = {"bf16": 2, "fp32": 4}  # the full precisions the benchmark serves MorphServe in (--dtype)
BF16_BYTES = DTYPE_BYTES["bf16"]
MIB = 2**20

STATIC_FP = "morphserve-static-fp"
STATIC_INT4 = "morphserve-static-int4"
VLLM = "vllm-cpu"
ALL_SYSTEMS = (STATIC_FP, STATIC_INT4, "morphserve-accuracy", "morphserve-balanced", "morphserve-performance", VLLM)
QUICK_SYSTEMS = (STATIC_FP, STATIC_INT4, "morphserve-balanced", VLLM)

# --fleet (issue 14): 2 engine replicas per system, each with the single-replica budget (same total
# memory for both systems), 1 thread each; both in balanced mode.
FLEET_BASELINE = "fleet-serve-router"  # Serve's default router + every replica's own (local) policy
FLEET_PRESSURE = "fleet-pressure-router"  # the fleet controller + the pressure-aware router
# The A/B halves (`--systems`): which of the two parts helps, and which hurts.
FLEET_CONTROLLER_ONLY = "fleet-controller-only"  # the fleet controller (and its budget) + Serve's default router
FLEET_ROUTER_ONLY = "fleet-router-only"  # every replica's local policy + the pressure-aware router
FLEET_REPLICAS = 2
# AppArgs switches (deployments/app_args.py) that tell them apart; a build without them can only
# run the baseline as the app's default (fleet_note says so in the report).
FLEET_SWITCHES = {FLEET_BASELINE: {"fleet_controller": False, "pressure_router": False},
                  FLEET_PRESSURE: {"fleet_controller": True, "pressure_router": True},
                  FLEET_CONTROLLER_ONLY: {"fleet_controller": True, "pressure_router": False},
                  FLEET_ROUTER_ONLY: {"fleet_controller": False, "pressure_router": True}}
FLEET_SYSTEMS = tuple(FLEET_SWITCHES)
BUDGETED = (FLEET_PRESSURE, FLEET_CONTROLLER_ONLY)  # the systems that run the fleet accuracy budget


def _app_fields() -> set[str]:
    from deployments.app_args import AppArgs

    return set(AppArgs.model_fields)


def fleet_switches_available() -> bool:
    return all(k in _app_fields() for switches in FLEET_SWITCHES.values() for k in switches)


def fleet_systems() -> tuple[str, ...]:
    return (FLEET_BASELINE, FLEET_PRESSURE) if fleet_switches_available() else (FLEET_BASELINE,)


def fleet_budget_layers(num_layers: int, replicas_worth: float) -> int:
    """The fleet accuracy budget of FLEET_PRESSURE (AppArgs.fleet_max_quantized_layers): `replicas_worth`
    times one replica's balanced-mode cap. 1.0: the fleet may lose, in sum, the precision one replica
    may lose alone; the baseline's replicas may each go to their cap (twice that)."""
    from controller.policy_config import PolicyConfig

    cap = PolicyConfig(mode="balanced").active.cap_layers(num_layers)
    if not replicas_worth > 0:
        raise BenchmarkInputError(f"fleet_budget_replicas={replicas_worth}: give a positive number of replicas' caps")
    return max(1, min(FLEET_REPLICAS * cap, round(replicas_worth * cap)))


def fleet_note(systems, budget_layers: int | None = None, controller_overrides: Mapping[str, Any] = {}) -> str | None:
    ran = [s for s in systems if s in FLEET_SYSTEMS]
    if not ran:
        return None
    if fleet_switches_available():
        budgeted = [s for s in ran if s in BUDGETED]
        settings = (f"; fleet_max_quantized_layers={budget_layers} (one accuracy budget for the fleet) for "
                    f"{', '.join(budgeted)}, none for the others" if budget_layers is not None and budgeted else "")
        for key, value in (controller_overrides.items() if budgeted else ()):
            settings += f"; {key}={value:g} for them" if isinstance(value, float) else f"; {key}={value} for them"
            if key == "fleet_restore_quiet_s" and value is None:
                settings += " (off: restores wait the engine's restore_quiet_s)"
        return (f"fleet: {FLEET_REPLICAS} replicas per system, each with the budget above and 1 thread{settings}; "
                f"{', '.join(f'{s} = {FLEET_SWITCHES[s]}' for s in ran)}; "
                f"quantized layer-seconds summed over the replicas, from each replica's own quantized_history "
                f"(GET /admin/morph), exact to one report interval")
    return (f"fleet: this build's AppArgs has no {sorted(FLEET_SWITCHES[FLEET_PRESSURE])} switches, so only "
            f"{FLEET_BASELINE} ran, as the app's default ({FLEET_REPLICAS} replicas, fleet controller, Serve's "
            f"router); the pressure-aware side is not measured here")


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the budget arithmetic needs from a Hugging Face folder (config.json + safetensors headers)."""
    hf_dir: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_kv_heads: int
    head_dim: int
    num_params: int  # stored tensors (tied embeddings counted once, as they are resident once)

    def kv_bytes_per_token(self, elem: int = BF16_BYTES) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def weight_bytes(self, elem: int = BF16_BYTES) -> int:
        return self.num_params * elem

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> "ModelFacts":
        path = Path(hf_dir)
        try:
            cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BenchmarkInputError(f"{path}/config.json is unreadable ({e}); pass a Hugging Face model folder") from None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise BenchmarkInputError(f"{path} has no *.safetensors file; pass a Hugging Face model folder")
        heads = cfg["num_attention_heads"]
        return cls(hf_dir=str(path), num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                   num_kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   num_params=sum(_safetensors_params(f) for f in files))


def _safetensors_params(path: Path) -> int:
    """Element count of every tensor in a safetensors file, from its JSON header only."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for d in info["shape"]:
            n *= d
        total += n
    return total


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """B = weights + reserve + kv, all in `dtype`. kv holds `kv_sequences` full-length sequences at full precision."""
    budget_bytes: int
    weight_bytes: int
    reserve_bytes: int
    kv_bytes: int  # what B leaves for KV with every layer in full precision (static FP, and vLLM's KV)
    kv_bytes_per_token: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    dtype: str = "bf16"  # MorphServe's full precision (vLLM keeps its bf16 default)

    @property
    def kv_blocks(self) -> int:
        return self.kv_bytes // (self.kv_bytes_per_token * self.block_size)

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def check_integrity(self) -> None:
        if self.weight_bytes + self.reserve_bytes + self.kv_bytes != self.budget_bytes:
            raise AssertionError("weights + reserve + kv != budget")
        if self.kv_tokens < self.max_model_len:
            raise AssertionError("the full-precision KV cannot hold one max-length sequence")

    def describe(self) -> str:
        return (f"{self.budget_bytes / MIB:.1f} MiB = {self.dtype} weights {self.weight_bytes / MIB:.1f} MiB + activation "
                f"reserve {self.reserve_bytes / MIB:.1f} MiB (max_num_batched_tokens {self.max_num_batched_tokens} x "
                f"(hidden + intermediate + vocab) x {DTYPE_BYTES[self.dtype]} B) + KV {self.kv_bytes / MIB:.2f} MiB "
                f"({self.kv_blocks} blocks of {self.block_size} tokens = {self.kv_tokens} tokens at "
                f"{self.kv_bytes_per_token} B/token in full precision; more when layers are quantized)")

    def describe_vllm(self, vllm_block: int, vllm_tokens: int) -> str:
        return (f"vLLM: --kv-cache-memory-bytes {self.kv_bytes} (the same KV bytes), block size {vllm_block} "
                f"(its CPU attention needs a multiple of 32), so {vllm_tokens} KV tokens vs {self.kv_tokens}")


def plan_budget(facts: ModelFacts, max_model_len: int, kv_sequences: float, block_size: int = 16,
                max_num_batched_tokens: int = 512, weight_bytes: int | None = None, dtype: str = "bf16") -> BudgetPlan:
    """The budget that leaves KV for `kv_sequences` sequences of `max_model_len` tokens at full
    precision (`dtype`), rounded up to whole MiB (the extra bytes go to KV). `weight_bytes`: what the
    engine's ledger counts (it adds the RoPE tables to the stored tensors); default: the stored tensors."""
    if max_model_len < block_size or kv_sequences < 1:
        raise BenchmarkInputError(f"max_model_len={max_model_len}, kv_sequences={kv_sequences}: need "
                                  f"max_model_len >= block_size ({block_size}) and kv_sequences >= 1")
    if dtype not in DTYPE_BYTES:
        raise BenchmarkInputError(f"dtype={dtype!r}: the benchmark serves MorphServe in {sorted(DTYPE_BYTES)}")
    elem = DTYPE_BYTES[dtype]
    reserve = max_num_batched_tokens * (facts.hidden_size + facts.intermediate_size + facts.vocab_size) * elem
    per_token = facts.kv_bytes_per_token(elem)
    kv_min = -(-int(kv_sequences * max_model_len) // block_size) * block_size * per_token
    weights = facts.weight_bytes(elem) if weight_bytes is None else weight_bytes
    budget = -(-(weights + reserve + kv_min) // MIB) * MIB
    plan = BudgetPlan(budget_bytes=budget, weight_bytes=weights, reserve_bytes=reserve,
                      kv_bytes=budget - weights - reserve, kv_bytes_per_token=per_token, block_size=block_size,
                      max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, dtype=dtype)
    plan.check_integrity()
    return plan


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    name: str
    kind: Literal["morphserve", "vllm"]
    description: str
    enable_morphing: bool = True  # EngineConfig.enable_morphing (False: no KV headroom is reserved)
    mode: str | None = None  # the policy mode of a dynamic system
    pin_int4_layers: int | None = None  # static INT4: pinned through POST /admin/morph after start
    replicas: int = 1
    app_args: Mapping = dataclasses.field(default_factory=dict)  # AppArgs overrides (fleet switches)

    def admin_updates(self) -> tuple[dict, ...]:
        """POST /admin/morph bodies to send once the server is ready, in order."""
        if self.pin_int4_layers is not None:
            return ({"quantized_layers": self.pin_int4_layers, "precision": "int4"},)
        return ()


def system_specs(names: Sequence[str], num_layers: int, fleet_budget_replicas: float = 1.0,
                 controller_overrides: Mapping[str, Any] = {}) -> tuple[SystemSpec, ...]:
    """`fleet_budget_replicas`: FLEET_PRESSURE's fleet accuracy budget, in replicas' caps (fleet_budget_layers).
    `controller_overrides`: AppArgs the controller systems get beyond the app's defaults
    (BenchConfig.controller_overrides)."""
    known = {s.name: s for s in _all_specs(num_layers, fleet_budget_layers(num_layers, fleet_budget_replicas),
                                           controller_overrides)}
    if any(n in FLEET_SYSTEMS and n != FLEET_BASELINE for n in names) and not fleet_switches_available():
        raise BenchmarkInputError(f"{names} need AppArgs {sorted(FLEET_SWITCHES[FLEET_PRESSURE])}, which "
                                  f"this build lacks; run {FLEET_BASELINE} only")
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise BenchmarkInputError(f"unknown system(s) {unknown or '(none given)'}; choose from {', '.join(ALL_SYSTEMS)}")
    if len(set(names)) != len(names):
        raise BenchmarkInputError(f"systems {list(names)} repeat a name; name each system once")
    return tuple(known[n] for n in names)


def _all_specs(num_layers: int, fleet_budget: int,
               controller_overrides: Mapping[str, Any] = {}) -> tuple[SystemSpec, ...]:
    dynamic = tuple(SystemSpec(f"morphserve-{m}", "morphserve", f"MorphServe dynamic, {m} mode", mode=m)
                    for m in ("accuracy", "balanced", "performance"))
    return (SystemSpec(STATIC_FP, "morphserve", "MorphServe, morphing off (all layers bf16)", enable_morphing=False),
            SystemSpec(STATIC_INT4, "morphserve", f"MorphServe, all {num_layers} layers pinned to INT4",
                       pin_int4_layers=num_layers),
            *dynamic,
            SystemSpec(VLLM, "vllm", "vLLM CPU build, bf16, same KV bytes"),
            *(SystemSpec(name, "morphserve", f"MorphServe fleet, {FLEET_REPLICAS} replicas", mode="balanced",
                         replicas=FLEET_REPLICAS,
                         app_args=(_fleet_args(name, fleet_budget, controller_overrides)
                                   if fleet_switches_available() else {}))
              for name in FLEET_SYSTEMS))


def _fleet_args(name: str, fleet_budget: int, controller_overrides: Mapping[str, Any] = {}) -> dict:
    if name not in BUDGETED:  # no controller: the switches alone
        return dict(FLEET_SWITCHES[name])
    return {**FLEET_SWITCHES[name], "fleet_max_quantized_layers": fleet_budget, **controller_overrides}


def interleaved_schedule(systems: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, system) in run order: repeat r runs the systems rotated left by r, so each system
    takes every position (early/late, after any neighbour) across repeats."""
    if repeats < 1 or not systems:
        raise BenchmarkInputError(f"repeats={repeats}, systems={list(systems)}: need >= 1 repeat and >= 1 system")
    n = len(systems)
    return [(r, systems[(r + i) % n]) for r in range(repeats) for i in range(n)]


def morphserve_app_args(spec: SystemSpec, plan: BudgetPlan, model: str, admin_token: str,
                        max_num_seqs: int = 64) -> dict:
    """The `args:` of the serve config (deployments/app_args.py: AppArgs): the plan's dtype, CPU."""
    if spec.kind != "morphserve":
        raise BenchmarkInputError(f"{spec.name} is not a MorphServe system")
    return {"model": model, "memory_budget": plan.budget_bytes, "dtype": plan.dtype, "device": "cpu",
            "mode": spec.mode or "balanced", "num_replicas": spec.replicas, "admin_token": admin_token,
            **dict(spec.app_args),
            "engine": {"enable_morphing": spec.enable_morphing, "block_size": plan.block_size,
                       "max_model_len": plan.max_model_len, "max_num_seqs": max_num_seqs,
                       "max_num_batched_tokens": plan.max_num_batched_tokens}}


def serve_config(app_args: Mapping, port: int) -> dict:
    """A Serve config (written as JSON, which YAML reads) so each run gets its own HTTP port."""
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "morphserve", "route_prefix": "/", "import_path": "deployments:build_app",
                              "args": dict(app_args)}]}


def morphserve_command(serve_bin: str, config_path: str) -> list[str]:
    # --address local: a private Ray instance per run, never another engineer's cluster.
    return [serve_bin, "run", "--address", "local", config_path]


VLLM_CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes block sizes that are multiples of 32


def vllm_block_size(plan: BudgetPlan) -> int:
    return -(-plan.block_size // VLLM_CPU_BLOCK_MULTIPLE) * VLLM_CPU_BLOCK_MULTIPLE


def vllm_kv_tokens(plan: BudgetPlan) -> int:
    """vLLM's KV capacity from the same bytes: whole blocks of vllm_block_size tokens (rounded down)."""
    block = vllm_block_size(plan)
    return plan.kv_bytes // (plan.kv_bytes_per_token * block) * block


def vllm_command(python_bin: str, hf_dir: str, port: int, plan: BudgetPlan, served_name: str) -> list[str]:
    return [python_bin, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
            "--served-model-name", served_name, "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(plan.max_model_len), "--block-size", str(vllm_block_size(plan)),
            "--max-num-batched-tokens", str(plan.max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(plan.kv_bytes)]


def vllm_env(threads: int) -> dict[str, str]:
    """VLLM_CPU_KVCACHE_SPACE stays unset: it is read as whole GiB (int), so our KV would round up
    to 1 GiB; --kv-cache-memory-bytes gives vLLM exactly the KV bytes of the others."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


# Values the report's timeline plots look for, from each server's status body.
_MORPHSERVE_KEYS = {"kv_usage": "pressure.kv_usage", "kv_capacity_blocks": "morph_state.kv_capacity_blocks",
                    "kv_used_blocks": "pressure.kv_used_blocks", "num_waiting": "pressure.num_waiting",
                    "reservation_tokens": "pressure.reservation_tokens",  # with admission-time morphing
                    "admission_swaps_total": "pressure.admission_swaps_total",
                    "last_blocked_for_s": "admission.last_blocked_for_s",  # the engine's own head-of-queue wait
                    "quantized_layers": "morph_state.num_quantized", "preemptions_total": "pressure.preemptions_total"}
VLLM_METRICS = {"kv_usage": "vllm:kv_cache_usage_perc", "preemptions_total": "vllm:num_preemptions_total",
                "num_waiting": "vllm:num_requests_waiting"}


def morphserve_status(body: str) -> dict[str, float]:
    """GET /admin/morph (deployments/replica.py: admin_status) -> the plot's names."""
    flat = parse_json_status(body)
    return {key: flat[path] for key, path in _MORPHSERVE_KEYS.items() if path in flat}


def morphserve_labels(body: str) -> dict[str, str]:
    """The configuration in force (ops/bench/served_quality.py: config_label), from the layer precisions."""
    from engine.precision import Precision
    from ops.bench.served_quality import config_label

    state = json.loads(body).get("morph_state") or {}
    precisions = state.get("precisions")
    if not isinstance(precisions, list):
        return {}
    full = next((p for p in precisions if Precision(p).is_full), Precision.BF16.value)  # bf16: every layer quantized
    return {"config": config_label(precisions, full)}


def vllm_status_parser():
    return prometheus_status_parser(VLLM_METRICS)
