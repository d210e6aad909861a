"""The swap order: which layer is quantized first, second, ... (restores walk it backwards).

It comes from a Layer Importance Score profile (engine/morph/profiler.py writes it) or, without one,
front to back. A profile is JSON:

    {"model": "SmolLM2-135M-Instruct", "num_layers": 30, "order": [29, 3, ...], "scores": [...],
     "calibration": {...}}

Only `num_layers` and `order` matter here; they are checked against the model at load time, so a
profile made for another model fails at start-up, not in the middle of a burst.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)
PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"  # committed profiles (engine/profiles/)
PROFILE_SUFFIX = ".lis.json"


@dataclasses.dataclass(frozen=True)
class SwapOrder:
    order: tuple[int, ...]  # a permutation of the layer ids; order[0] is swapped down first
    source: str  # "lis:<profile path>" or "front-to-back"

    @classmethod
    def front_to_back(cls, num_layers: int) -> "SwapOrder":
        return cls(tuple(range(num_layers)), "front-to-back")

    def check_integrity(self, num_layers: int) -> None:
        if sorted(self.order) != list(range(num_layers)):
            raise ModelLoadError(f"swap order {list(self.order)} ({self.source}) is not a permutation of the "
                                 f"model's layers 0..{num_layers - 1}")


def committed_profile_path(model_name: str) -> Path:
    """Where the project commits a model's profile: engine/profiles/<model name>.lis.json."""
    return PROFILES_DIR / f"{model_name}{PROFILE_SUFFIX}"


def prepared_profile_path(cache_dir: Path, model_name: str) -> Path:
    """Where `python -m engine.morph.prepare --profile` writes a model's profile (preferred to the committed one)."""
    return Path(cache_dir) / "models" / model_name / f"{model_name}{PROFILE_SUFFIX}"


def load_swap_order(path: str | Path, num_layers: int, model_name: str | None = None) -> SwapOrder:
    """Read and validate a profile; ModelLoadError says what is wrong and what to do."""
    path = Path(path)
    hint = "re-run `python -m engine.morph.prepare --profile` for this model, or drop the profile setting"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelLoadError(f"cannot read layer-importance profile {path} ({e}); {hint}") from e
    except ValueError as e:
        raise ModelLoadError(f"layer-importance profile {path} is not valid JSON ({e}); {hint}") from e
    order = data.get("order") if isinstance(data, dict) else None
    if not isinstance(order, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in order):
        raise ModelLoadError(f"profile {path} needs an 'order' list of layer ids; {hint}")
    declared = data.get("num_layers", num_layers)
    if declared != num_layers:
        raise ModelLoadError(f"profile {path} is for a model with {declared} layers; this model has {num_layers}; {hint}")
    unknown = sorted({i for i in order if not 0 <= i < num_layers})
    if unknown:
        raise ModelLoadError(f"profile {path} names layers {unknown} that the model does not have (it has layers "
                             f"0..{num_layers - 1}); {hint}")
    if len(set(order)) != len(order) or len(order) != num_layers:
        raise ModelLoadError(f"profile {path}: 'order' must list each of the {num_layers} layers exactly once, "
                             f"got {len(order)} entries ({len(set(order))} distinct); {hint}")
    if model_name is not None and data.get("model") not in (None, model_name):
        logger.warning("profile %s was made for model %r, this is %r; using its order anyway",
                       path, data.get("model"), model_name)
    return SwapOrder(tuple(order), f"lis:{path}")


def resolve_swap_order(num_layers: int, model_name: str, profile: str | None = None,
                       prepared_profile: Path | None = None) -> SwapOrder:
    """The configured profile, else the one `prepare --profile` wrote, else the committed one, else
    front-to-back. A configured profile that is missing or wrong is an error, never silently skipped."""
    if profile is not None:
        return load_swap_order(profile, num_layers, model_name)
    for candidate in (prepared_profile, committed_profile_path(model_name)):
        if candidate is not None and candidate.is_file():
            return load_swap_order(candidate, num_layers, model_name)
    return SwapOrder.front_to_back(num_layers)
