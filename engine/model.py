"""The Llama-family transformer (Llama, Mistral, Qwen2), gpt-fast style: each block reads like its
equations. Every layer's 7 linears and 2 norms can be replaced atomically between steps
(`DecoderLayer.set_weights`), which is how the morph executor changes a layer's precision.

Shapes: T = tokens in the step's flat batch, H = hidden_size, Hq / Hkv = query / kv heads, D = head_dim.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.activation import silu_and_mul
from engine.layers.attention import AttentionMetadata, paged_attention
from engine.layers.linear import DenseLinear, FusedWeight, Linear, fuse_dense, tensor_nbytes
from engine.layers.packed import (PackedGroup, PackedLinear, onednn_linear, pack_group, packed_group_of, vnni_layout_fits,
                                  vnni_rows)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.quant.fused import FusedQuantized, fuse_quantized

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
LINEAR_NAMES = ATTENTION_LINEARS + MLP_LINEARS
NORM_NAMES = ("input_layernorm", "post_attention_layernorm")
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # each runs as one matmul when it can

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [max_blocks, block_size, Hkv, D]


def layer_weight_names(config: ModelConfig, i: int) -> dict[str, str]:
    """linear name -> HF weight name of layer i (its bias, when it has one, is the same name with
    `.bias` for `.weight`; see `layer_bias_names`)."""
    return {n: f"model.layers.{i}.{'self_attn' if n in ATTENTION_LINEARS else 'mlp'}.{n}.weight"
            for n in LINEAR_NAMES}


def layer_bias_names(config: ModelConfig, i: int) -> dict[str, str]:
    """The linears of layer i that carry a bias: Qwen2 on q/k/v; Llama/Mistral with attention_bias on
    q/k/v/o (as transformers builds them)."""
    if not config.attention_bias:
        return {}
    names = ("q_proj", "k_proj", "v_proj") if config.architecture == "qwen2" else ATTENTION_LINEARS
    weights = layer_weight_names(config, i)
    return {n: weights[n].removesuffix(".weight") + ".bias" for n in names}


def layer_norm_names(config: ModelConfig, i: int) -> dict[str, str]:
    return {n: f"model.layers.{i}.{n}.weight" for n in NORM_NAMES}


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """linear name -> (out_features, in_features)."""
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (config.q_size, h), "k_proj": (config.kv_size, h), "v_proj": (config.kv_size, h),
            "o_proj": (h, config.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _single_dense(lin: Linear) -> FusedWeight | None:
    return (lin.weight, lin.bias) if type(lin) is DenseLinear else None


def _run(fused: FusedWeight | PackedGroup | FusedQuantized, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, *fused) if isinstance(fused, tuple) else fused(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.index, self.config = index, config
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        self.pack = False  # pre-pack dense weights for oneDNN (set by Transformer.pack_linears)
        self.fuse_residual = True  # Transformer.forward runs forward_residual; False: forward (hooks)
        biased = layer_bias_names(config, index)
        for name, (out_f, in_f) in linear_shapes(config).items():
            setattr(self, name, DenseLinear.empty(in_f, out_f, name in biased, dtype, device))
        for name in NORM_NAMES:
            weight = torch.empty(config.hidden_size, dtype=dtype, device=device)
            setattr(self, name, RMSNorm(weight, config.rms_norm_eps))
        self._fuse()

    def _fuse(self) -> None:
        """q/k/v -> one matmul, gate/up -> one matmul, when each group is all DenseLinear (fewer, larger
        matmuls are faster on CPU). The 7 linears stay what get_linears() returns; the fused weights
        share their storage (see fuse_dense), so memory and the ledger's bytes are unchanged. A quantized
        group is one kernel call where its format allows (engine/quant/fused.py); a mixed group runs its
        linears one by one.

        With `pack` set (Transformer.pack_linears), each dense group (q/k/v, o, gate/up, down) is then
        packed for oneDNN (engine/layers/packed.py) and its linears become PackedLinear rows of it: the
        plain copy is dropped, so packing happens here, when a layer is loaded or restored. A quantized
        o or down then runs through the same lean call as a fused group, not as a module."""
        # Plain (weight, bias) tuples or PackedGroups, not modules or buffers: their storage is the
        # linears' own, counted once.
        self._qkv, self._gate_up = (self._group(names) for names in FUSED_GROUPS)
        self._o = self._group(("o_proj",)) if self.pack else None
        self._down = self._group(("down_proj",)) if self.pack else None

    def _group(self, names: tuple[str, ...]) -> FusedWeight | PackedGroup | FusedQuantized | None:
        linears = [getattr(self, n) for n in names]
        packed = packed_group_of(linears)
        if packed is not None:  # a restore of this layer's own saved members: already packed
            return packed
        fused = fuse_dense(linears) if len(linears) > 1 else _single_dense(linears[0])
        if fused is None:  # quantized: q/k/v and gate/up as one kernel call each where the format allows
            return fuse_quantized(linears)
        if not self.pack:
            return fused
        group, members = pack_group(*fused, [lin.out_features for lin in linears])
        for name, member in zip(names, members):
            setattr(self, name, member)
        return group

    def get_linears(self) -> dict[str, Linear]:
        return {n: getattr(self, n) for n in LINEAR_NAMES}

    def get_norm_weights(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n).weight for n in NORM_NAMES}

    def set_weights(self, linears: Mapping[str, Linear], norm_weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Replace all 7 linears (and, when given, both norm weights) at once. Everything is checked
        before anything changes, so a bad argument leaves the layer as it was."""
        if set(linears) != set(LINEAR_NAMES):
            raise ValueError(f"layer {self.index}: set_weights needs exactly the linears {LINEAR_NAMES}, got {sorted(linears)}")
        for name, (out_f, in_f) in linear_shapes(self.config).items():
            lin = linears[name]
            if (lin.out_features, lin.in_features) != (out_f, in_f):
                raise ValueError(f"layer {self.index}: {name} must be {in_f} -> {out_f} features, "
                                 f"got {lin.in_features} -> {lin.out_features}")
        if norm_weights is not None:
            if set(norm_weights) != set(NORM_NAMES):
                raise ValueError(f"layer {self.index}: norm_weights needs exactly {NORM_NAMES}, got {sorted(norm_weights)}")
            for name in NORM_NAMES:
                if norm_weights[name].shape != (self.config.hidden_size,):
                    raise ValueError(f"layer {self.index}: {name} weight must be [{self.config.hidden_size}], "
                                     f"got {tuple(norm_weights[name].shape)}")
        for name in LINEAR_NAMES:
            setattr(self, name, linears[name])
        self._fuse()
        if norm_weights is not None:
            for name in NORM_NAMES:
                getattr(self, name).set_weight(norm_weights[name])

    def weight_bytes(self) -> int:
        return sum(lin.nbytes() for lin in self.get_linears().values())

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        """The layer's input hidden states -> its output, each submodule called as a module (so hooks see
        every input: engine/quant/awq.py record_calibration). Transformer.forward runs forward_residual."""
        h = x + self.attention(self.input_layernorm(x), positions, rope, meta, kv)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                         rope: RotaryEmbedding, meta: AttentionMetadata, kv: KVCache
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with the residual stream carried apart: the layer's input is residual + x (x alone
        when residual is None) and its output is the sum of the two returned tensors (mlp out, residual).
        Each residual add then runs inside the norm that follows it (RMSNorm.add_forward), the same
        roundings as forward()'s adds, so the two are bit-identical (tests/test_fused_linears.py)."""
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual)
        a = self.attention(normed, positions, rope, meta, kv)
        normed, residual = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(normed), residual

    def attention(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                  meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        # One matmul over every token of the step, decodes and prefill chunks alike.
        if self._qkv is not None:
            qkv = _run(self._qkv, x).view(t, hq + 2 * hkv, d)  # [T, Hq | Hkv | Hkv, D]
            qk = rope.rotate(qkv[:, :hq + hkv], positions)  # q and k side by side: one rotation
            q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]
        else:
            q = self.q_proj(x).view(t, hq, d)  # [T, Hq, D]
            k = self.k_proj(x).view(t, hkv, d)  # [T, Hkv, D]
            v = self.v_proj(x).view(t, hkv, d)
            q, k = rope(q, k, positions)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, Hq, D]
        o = o.reshape(t, hq * d)
        return self.o_proj(o) if self._o is None else self._o(o)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is not None:
            h = silu_and_mul(_run(self._gate_up, x))  # [T, 2I] -> [T, I]
        else:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h) if self._down is None else self._down(h)


class Transformer(nn.Module):
    """Weights start uninitialised; `build_model` fills them. forward() -> hidden states,
    compute_logits() -> fp32 logits of the rows that need them."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config, self.dtype = config, dtype
        embed = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.register_buffer("embed_weight", embed, persistent=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device) for i in range(config.num_layers))
        self.norm = RMSNorm(torch.empty(config.hidden_size, dtype=dtype, device=device), config.rms_norm_eps)
        # Tied: the head is a DenseLinear over the embedding's own tensor (one copy in memory).
        self.lm_head = (DenseLinear(embed) if config.tie_word_embeddings
                        else DenseLinear.empty(config.hidden_size, config.vocab_size, False, dtype, device))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                      config.rope_scaling, dtype, device)
        self._head_copy: PackedGroup | None = None  # see pack_head_copy
        self._onednn_head = False  # see pack_linears

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def head_packed_in_place(self) -> bool:
        """lm_head is its vnni32-packed self, with no plain copy (see pack_linears)."""
        return isinstance(self.lm_head, PackedLinear)

    def pack_head_copy(self) -> None:
        """Keep a second, oneDNN-packed copy of lm_head beside the plain one, where pack_linears cannot
        pack it in place (a tied head in oneDNN's opaque layout, which the embedding lookup cannot read:
        fp32). At a decode step's few rows F.linear re-blocks the whole vocab x hidden matrix on every call.
        The copy is counted in base_weight_bytes(), so call this before the memory plan reads them
        (engine/engine_builder.py does, with EngineConfig.pack_lm_head). Idempotent; a no-op where the head
        packs in place."""
        if self._head_copy is None and not vnni_layout_fits(self.lm_head.weight):
            self._head_copy = PackedGroup(self.lm_head.weight, self.lm_head.bias)

    def pack_linears(self) -> None:
        """Pre-pack every layer's dense linears from now on, including layers installed later by a swap
        or restore, and lm_head in place where the vnni32 layout holds it (engine/layers/packed.py). Call
        after the weights are loaded: hf_tensors() of a packed layer or head returns copies, not the storage."""
        for layer in self.layers:
            layer.pack = True
            layer._fuse()
        self._pack_head_in_place()
        # fp32: F.linear is MKL's sgemm; oneDNN on the same plain head (no second copy) took 0.43-0.52x
        # its time at 1-32 rows on an AVX2 EPYC. In bf16 F.linear is oneDNN already.
        self._onednn_head = self.dtype == torch.float32

    def _pack_head_in_place(self) -> None:
        """lm_head -> a PackedLinear over its vnni32 layout, and the plain tensor is dropped: same bytes,
        so the ledger is unchanged. F.linear re-blocks the 49,152 x 576 head of SmolLM2 on every call: in a
        decode step the logits took 0.29-0.36x its time at batch 1 and 0.57-0.60x at 32 (ops/bench/lm_head.py,
        Zen 4, 2 threads). A tied table is the embedding too; the lookup then reads its rows from the packed
        layout (embed)."""
        if self.head_packed_in_place or not vnni_layout_fits(self.lm_head.weight):
            return
        _, (head,) = pack_group(self.lm_head.weight, self.lm_head.bias, [self.config.vocab_size])
        self.set_head(head)

    def set_head(self, head: Linear) -> None:
        """Install `head` as lm_head. Invariant: a tied plain head's weight is the embedding table; a tied
        packed head keeps no table (embed reads its rows from the packed layout)."""
        self.lm_head = head
        if self.config.tie_word_embeddings:
            self.embed_weight = None if self.head_packed_in_place else head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] long -> [T, H]: rows of the embedding table, wherever it lives."""
        if self.embed_weight is None:  # tied, and kept only as the packed head
            return vnni_rows(self.lm_head.group.packed, input_ids)
        return F.embedding(input_ids, self.embed_weight)

    @property
    def max_positions(self) -> int:
        return self.rotary.max_positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: Sequence[KVCache]) -> torch.Tensor:
        """input_ids, positions: [T] long; kv_caches[l] = layer l's (k, v) views -> hidden [T, H]."""
        x = self.embed(input_ids)  # [T, H]
        residual = None  # the hidden states are x + residual (x alone while None)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            if layer.fuse_residual:
                x, residual = layer.forward_residual(x, residual, positions, self.rotary, meta, kv)
            else:
                x, residual = layer(x if residual is None else residual + x, positions, self.rotary, meta, kv), None
        return x if residual is None else residual + x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> fp32 logits [N, vocab]."""
        normed = self.norm(hidden)
        if self._head_copy is not None:
            return self._head_copy(normed).float()
        if self._onednn_head:
            return onednn_linear(normed, self.lm_head.weight, self.lm_head.bias).float()
        return self.lm_head(normed).float()

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """HF name -> the tensor this model owns for it (what build_model fills)."""
        embed = self.lm_head.weight if self.embed_weight is None else self.embed_weight  # a copy if packed
        out = {"model.embed_tokens.weight": embed, "model.norm.weight": self.norm.weight}
        if not self.config.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            linears = layer.get_linears()
            out.update({hf: linears[n].weight for n, hf in layer_weight_names(self.config, i).items()})
            out.update({hf: linears[n].bias for n, hf in layer_bias_names(self.config, i).items()})
            norms = layer.get_norm_weights()
            out.update({hf: norms[n] for n, hf in layer_norm_names(self.config, i).items()})
        return out

    def base_weight_bytes(self) -> int:
        """Bytes outside the swappable linears: embeddings, every norm, lm_head (once if tied, in whichever
        of the two it lives; plus its packed copy, see pack_head_copy), RoPE cache."""
        tensors = [self.embed_weight, self.norm.weight, self.rotary.cos, self.rotary.sin]  # tensor_nbytes(None) = 0
        for layer in self.layers:
            tensors.extend(layer.get_norm_weights().values())
        shares_embed = self.config.tie_word_embeddings and self.embed_weight is not None
        head = 0 if shares_embed else self.lm_head.nbytes()
        copy = 0 if self._head_copy is None else self._head_copy.nbytes()
        return sum(tensor_nbytes(t) for t in tensors) + head + copy

    def layer_weight_bytes(self, i: int) -> int:
        """Bytes of layer i's 7 linears at their current precision."""
        return self.layers[i].weight_bytes()


def build_model(config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str) -> Transformer:
    """A Transformer whose tensors are fresh copies of `weights` (HF names), cast to `dtype` on `device`;
    nothing keeps a reference to the (memory-mapped) inputs. Extra names are ignored."""
    model = Transformer(config, dtype, device)
    with torch.no_grad():
        for name, target in model.hf_tensors().items():
            src = weights.get(name)
            if src is None:
                raise ModelLoadError(f"weight {name!r} is missing from the checkpoint; expected shape "
                                     f"{tuple(target.shape)} (is the config's architecture / tie_word_embeddings right?)")
            if tuple(src.shape) != tuple(target.shape):
                raise ModelLoadError(f"weight {name!r} has shape {tuple(src.shape)}, the config implies "
                                     f"{tuple(target.shape)}; the checkpoint and config.json disagree")
            target.copy_(src)
    return model.eval()
