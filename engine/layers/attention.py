"""Paged attention over the block-major KV storage.

Two routes, chosen once per runner (`in_place_supported`) and recorded in the metadata:

- in place (CPU, fp32/bf16, the compiled kernel built by `make`; engine/kernels/paged_attention.cpp):
  the decodes (step 2 below) are attended in one op call per layer that reads each request's K/V
  blocks where they lie (no gather copy). Prefill chunks keep step 3 below: for a chunk of n tokens
  the gather is O(context) against O(n * context) of attention, and SDPA's GEMMs beat the kernel's
  per-row dot products there (a 256-token chunk at position 512: 3.3 ms gather + SDPA vs 26 ms in the kernel).
- torch (CUDA, or when the kernel is not built): steps 1-3 below; it gathers each request's blocks.

One step runs a flat batch of T tokens (every scheduled chunk concatenated). The runner orders it

    rows [0, num_decodes)        one-token chunks (decodes), attended together in one batched call
    rows [num_decodes, T)        multi-token chunks (prefill), each attended on its own

and builds an `AttentionMetadata` once per step; every layer reuses it. Per layer:

  1. write K/V of all T new tokens into their slots:   k_cache[block, offset] = k   (one op call)
  2. decodes: gather each request's blocks by its block table into a padded [B*Hkv, S, D], one bmm
     for the scores, -inf on the padding, fp32 softmax, one bmm for the output; GQA by folding each
     kv head's group of query heads into the query-row axis (a kv head serves num_heads // num_kv_heads
     q heads)
  3. prefill chunks: a chunk at start_pos 0 attends causally to its own fresh K/V (no gather); a later
     chunk (chunked prefill) gathers its context [0, end_pos) from the cache and masks causally with
     its offset: query at position start_pos + i sees keys at positions <= start_pos + i. On a CPU
     with AVX512-BF16 (AMX or not) in bf16 both go through the engine's op
     (engine/kernels/causal_attention.cpp: 64-key blocks to the diagonal, the offset as data, no mask
     tensor); otherwise SDPA.

Cache views (k_cache, v_cache: [max_blocks, block_size, Hkv, D]) are strided slices of one tensor, so
they are indexed by (block, offset) rather than flattened; they may move after a KV resize, which is
why they are passed in every step and never stored.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.kernels import causal_attention_op, kv_write_op, paged_attention_op


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """The one-token chunks of a step; they are rows [0, num_tokens) of the flat batch."""
    num_tokens: int
    block_tables: torch.Tensor  # [B, max_blocks_per_req] long, padded with a valid id (masked out)
    key_bias: torch.Tensor  # [B, 1, 1, max_blocks_per_req * block_size] fp32: 0 where key position <
    #                         context length, -inf on the padding (added to the scores before softmax)


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """One multi-token chunk: rows [token_start, token_end) of the flat batch."""
    token_start: int
    token_end: int
    start_pos: int
    block_ids: torch.Tensor | None  # [nb] long, blocks covering [0, end_pos); None when start_pos == 0
    mask: torch.Tensor | None  # [n, end_pos] bool causal mask with offset; None when start_pos == 0 or the causal op serves prefill


@dataclasses.dataclass(frozen=True)
class PagedRuns:
    """The rows the in-place kernel attends: run r is rows [row_start[r], row_start[r] + num_rows[r])
    at positions start_pos[r] + i, each seeing keys at positions <= its own through block_tables[r]."""
    block_tables: torch.Tensor  # [R, max_blocks_per_run] long (CPU), padded with 0 (never read)
    row_start: torch.Tensor  # [R] long
    num_rows: torch.Tensor  # [R] long
    start_pos: torch.Tensor  # [R] long


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    write_blocks: torch.Tensor  # [T] long: block id of each new token's slot
    write_offsets: torch.Tensor  # [T] long: offset inside that block
    decode: DecodeBatch | None  # torch route only
    prefills: tuple[PrefillChunk, ...]
    paged: PagedRuns | None = None  # in-place route: the decodes (then `decode` is None)
    causal_op: bool = False  # prefill chunks through the causal op (`causal_op_supported`; chunks then carry no mask)


def in_place_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the in-place kernel serves this model: CPU, fp32 or bf16, and the library is built."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and paged_attention_op() is not None)


def causal_op_supported(dtype: torch.dtype, device: torch.device | str, head_dim: int) -> bool:
    """Whether prefill chunks go through the causal op (engine/kernels/causal_attention.cpp): CPU, bf16, a
    head dim that is a multiple of 32 up to 256, the op built and AVX512-BF16 here; else SDPA. The op walks 64-key
    blocks to the diagonal; SDPA's CPU kernel walks 512-key blocks and so computes about 75% of a
    1,024-token prompt's score matrix, not its causal half, and a later chunk's mask skips nothing."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and head_dim % 32 == 0
            and head_dim <= 256 and causal_attention_op() is not None)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """k, v: [T, Hkv, D] -> their slots in the cache (in place, through the strided views). On CPU one
    compiled call (engine/kernels/kv_write.cpp: a memcpy per row) where the rows are laid out for it."""
    op = kv_write_op() if k_cache.device.type == "cpu" else None
    if (op is not None and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
            and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v, k_cache, v_cache))):
        op(k_cache, v_cache, k, v, meta.write_blocks, meta.write_offsets)
        return
    index = (meta.write_blocks, meta.write_offsets)
    k_cache.index_put_(index, k.to(k_cache.dtype))
    v_cache.index_put_(index, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, Hkv, D], block_ids [..., nb] -> [..., nb * bs, Hkv, D]."""
    blocks = cache.index_select(0, block_ids.reshape(-1))
    return blocks.reshape(*block_ids.shape[:-1], -1, *cache.shape[2:])


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      d: DecodeBatch, scale: float) -> torch.Tensor:
    """q: [B, Hq, D] -> [B, Hq, D]."""
    b, hq, dim = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    # One [S, D] matrix per (request, kv head), contiguous, so two bmm calls cover the whole batch.
    keys = _gather(k_cache, d.block_tables).transpose(1, 2).reshape(b * hkv, -1, dim)  # [B*Hkv, S, D]
    values = _gather(v_cache, d.block_tables).transpose(1, 2).reshape(b * hkv, -1, dim)
    s = keys.shape[1]
    # GQA by folding: the hq // hkv query heads that share a kv head become that head's "query rows"
    # (q head h uses kv head h // group, as in HF). One query token has no causal structure, so this is
    # exact. Why bmm and not SDPA: with 1-3 query rows SDPA's per-(request, head) tiling costs several
    # times the arithmetic on CPU; bmm + softmax over the padded keys is one call each for the batch.
    scores = torch.bmm(q.reshape(b * hkv, group, dim), keys.to(q.dtype).transpose(1, 2))  # [B*Hkv, g, S]
    # Softmax in fp32 (as HF's eager attention), padding keys at -inf.
    scores = torch.add(d.key_bias, scores.view(b, hkv, group, s), alpha=scale)  # fp32 [B, Hkv, g, S]
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b * hkv, group, s)
    return torch.bmm(probs, values.to(q.dtype)).view(b, hq, dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, c: PrefillChunk, scale: float, causal_op: bool) -> torch.Tensor:
    """q: [n, Hq, D], k/v: [n, Hkv, D] (this chunk's fresh ones) -> [n, Hq, D]. `causal_op`: the
    engine's op (AttentionMetadata.causal_op), else SDPA."""
    if c.block_ids is None:  # first chunk: its whole context is itself
        keys, values, mask, causal = k, v, None, True
    else:
        end = c.start_pos + q.shape[0]
        keys, values = _gather(k_cache, c.block_ids)[:end], _gather(v_cache, c.block_ids)[:end]
        keys, values, mask, causal = keys.to(q.dtype), values.to(q.dtype), c.mask, False
    if causal_op:
        return causal_attention_op()(q, keys, values, c.start_pos, scale)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                         values.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                         is_causal=causal, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [n, Hq, D]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] (RoPE applied) -> attention output [T, Hq, D].

    Writes k/v into the cache first, so a decode sees its own token."""
    write_kv(k_cache, v_cache, k, v, meta)
    if meta.paged is not None:
        return _in_place_attention(q, k, v, k_cache, v_cache, meta, scale)
    if meta.decode is not None and not meta.prefills:  # pure decode step: no copy into `out`
        return _decode_attention(q, k_cache, v_cache, meta.decode, scale)
    out = torch.empty_like(q)
    if meta.decode is not None:
        n = meta.decode.num_tokens
        out[:n] = _decode_attention(q[:n], k_cache, v_cache, meta.decode, scale)
    for c in meta.prefills:
        s, e = c.token_start, c.token_end
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, c, scale, meta.causal_op)
    return out


def _in_place_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    p = meta.paged
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = paged_attention_op()(q, k_cache, v_cache, p.block_tables, p.row_start, p.num_rows, p.start_pos, scale)
    for c in meta.prefills:
        s, e = c.token_start, c.token_end
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, c, scale, meta.causal_op)
    return out
