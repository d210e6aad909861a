"""The fleet controller's process never imports torch.

Why it matters: the controller is a Ray actor that the first replica starts while the replicas
load their model. On the 2-core host of the fleet benchmark, an actor that imported torch (through
engine.precision and engine.capability) spent ~1.1 s of CPU doing so; when it was still created at
the first report it came up only as the replay began, and every controller run paid for it in its
first burst. The controller needs
only the records a replica sends, so it loads no tensor library at all.
"""
from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

from engine.capability import detect_capability
from engine.morph.actions import SetQuantizedTarget
from engine.precision import Precision
from tests.test_policy import make_state, snap

# What the actor process does: import the class Ray runs, then unpickle a replica's report.
CHILD = """
import pickle, sys
import controller.fleet
controller.fleet.FleetController().report("r1", *pickle.loads(sys.stdin.buffer.read()))
heavy = sorted(m for m in ("torch", "numpy", "transformers", "safetensors") if m in sys.modules)
print(",".join(heavy))
"""


def test_the_controller_imports_and_answers_a_real_report_without_torch():
    state = dataclasses.replace(make_state(quantized=2, pending=(SetQuantizedTarget(4, Precision.INT4),)),
                                capability=detect_capability("cpu"))  # as an engine reports it
    report = pickle.dumps((snap(1.0, 0.5), state))
    done = subprocess.run([sys.executable, "-c", CHILD], input=report, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "", f"the controller process imported {done.stdout.decode().strip()}"


def test_precision_dtypes_still_resolve_where_torch_is_wanted():
    import torch

    from engine.precision import full_precision_for, parse_dtype, torch_dtype

    assert torch_dtype(Precision.BF16) is torch.bfloat16
    assert parse_dtype("float32") is torch.float32
    assert full_precision_for(torch.float16) is Precision.FP16
