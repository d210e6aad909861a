"""SwiGLU's activation: silu(gate) * up, from the fused gate/up matmul's output [T, 2I] = [gate | up].

One pass on CPU with the compiled kernels (engine/kernels/fused_elementwise.cpp), else torch's two
ops; both round silu(gate) to the model dtype before the product, as Hugging Face does."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import elementwise_ops_for


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> [T, I]."""
    ops = elementwise_ops_for(gate_up)
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
