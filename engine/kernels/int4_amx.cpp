// INT4 x bf16 linear with AMX, reading torch's CPU int4pack bytes (AVX512 layout: 64-column blocks; the
// bytes the host store keeps and Int4Linear holds, so swaps and the ledger are unchanged).
//
// The weight is never dequantized. With w = code * s + b per (group g, column n) (b = zp - 8 s, torch's
// int4pack convention), a group's share of y[m][n] is
//     s[g][n] * sum_{k in g} x[m][k] * (128 + code[k][n])  +  (b[g][n] - 128 s[g][n]) * X_g[m],
// X_g[m] = sum_{k in g} x[m][k]. 128 + code is an exact bf16 (int4_codes.h turns a 64-column block's
// nibbles into AMX's VNNI layout with no float math per weight); AMX multiplies each group (K = G)
// into fp32 tiles (raw tile instructions: per-group GEMMs are small, and a library GEMM call per group
// cost more than the group's arithmetic) and the per-group scale and offset are applied to the
// [16 rows, 64 columns] result. The
// older route (each weight converted to fp32, scaled, rounded to bf16, then shuffled into pairs) spent
// most of its time in that per-weight work, which made an INT4 layer no faster than bf16 at 16 rows.
// The products are exact (bf16 x small integer) and the scale is applied in fp32, so the result is
// closer to the exact dequantized product than rounding each weight to bf16 was.
// Each output row depends only on its own input row (the same K order whatever the row count).
// Buffers (transient, part of the activation reserve): x padded to whole 16-row tiles, and per thread
// K x 64 x 2 bytes of codes and two [16, 64] fp32 blocks.
// torch's _weight_int4pack_mm_for_cpu has no AMX path; the engine dispatches between it and this op by
// row count (EngineConfig.int4_amx_min_rows, quant/dispatch.py).
// Compiled only where the compiler targets AVX512-BF16 + AVX512-VBMI + AMX-BF16 (-march=native);
// elsewhere the op is not registered and the engine keeps torch's kernel.
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "int4_codes.h"

namespace {

constexpr int64_t kBlockN = morphserve::kInt4BlockN;  // the int4pack layout's column block: 4 tiles of 16 columns
constexpr int64_t kTile = 16;    // rows of an A / C tile; bf16 pairs (32 k values) per B tile

using BF = at::BFloat16;

// Tiles 0-3: C (16 rows x 16 columns fp32, the block's 4 column tiles); 4: A (16 rows x 32 bf16);
// 5: B (16 bf16 pairs x 16 columns). All 16 rows x 64 bytes.
void configure_tiles() {
  morphserve::TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// part[16][64] = x rows [16] . codes of one group (G values of k) of one 64-column block.
void group_product(const BF* x, int64_t K, const BF* w, int64_t G, float* part) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < G; k += 32) {
    _tile_loadd(4, x + k, K * sizeof(BF));
    const BF* b = w + k * kBlockN;  // VNNI row k / 2, 128 bf16 per row
    _tile_loadd(5, b, kBlockN * 2 * sizeof(BF));
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, b + 32, kBlockN * 2 * sizeof(BF));
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, b + 64, kBlockN * 2 * sizeof(BF));
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, b + 96, kBlockN * 2 * sizeof(BF));
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, part, kBlockN * sizeof(float));
  _tile_stored(1, part + 16, kBlockN * sizeof(float));
  _tile_stored(2, part + 32, kBlockN * sizeof(float));
  _tile_stored(3, part + 48, kBlockN * sizeof(float));
}

at::Tensor int4_amx_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& sz) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.is_contiguous(), "scales_and_zeros must be contiguous bf16 [K/G, N, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = sz.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == N * K / 2 && packed.is_contiguous(), "packed must be int4pack uint8 [N, K/2]");
  TORCH_CHECK(group_size > 0 && sz.size(0) * group_size == K, "x has ", K, " columns, the weight ", sz.size(0) * group_size);
  TORCH_CHECK(N % kBlockN == 0 && group_size % 32 == 0 && K % group_size == 0 && sz.size(0) == K / group_size, "unsupported shape");
  TORCH_CHECK(morphserve::amx_permitted(), "the kernel did not grant AMX tile state (arch_prctl)");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t G = group_size, groups = K / G, Mp = (M + kTile - 1) / kTile * kTile;
  auto xc = x.contiguous();
  // Whole 16-row tiles; the padding rows are computed and dropped. Buffers of uint16_t, not BF:
  // a vector<BFloat16> is zeroed (and copied) one element at a time, which cost a third of the op.
  std::vector<uint16_t> xbuf(Mp * K);
  std::memcpy(xbuf.data(), xc.data_ptr<BF>(), M * K * sizeof(BF));
  const BF* xpad = reinterpret_cast<const BF*>(xbuf.data());
  std::vector<float> xsum(Mp * groups, 0.f);  // X_g[m] (padding rows 0)
  morphserve::int4_group_sums(xpad, M, K, G, xsum.data());
  const auto* pp = packed.data_ptr<uint8_t>();
  const auto* szp = sz.data_ptr<BF>();
  auto* yp = y.data_ptr<BF>();
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<uint16_t> wbuf(K * kBlockN);
    BF* w = reinterpret_cast<BF*>(wbuf.data());
    alignas(64) float part[kTile * kBlockN], acc[kTile * kBlockN];
    std::vector<float> scales(2 * groups * kBlockN);  // [groups][64] scale, then offset
    float* scale = scales.data();
    float* offset = scale + groups * kBlockN;
    for (int64_t nb = begin; nb < end; ++nb) {
      morphserve::int4_codes_vnni(pp + nb * K * 32, K, w);
      morphserve::int4_block_scales(szp, N, nb, groups, scale, offset);  // once for all row tiles
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {  // the block's codes stay in cache across row tiles
        const int64_t mc = std::min(kTile, M - m0);
        std::fill(acc, acc + kTile * kBlockN, 0.f);
        for (int64_t g = 0; g < groups; ++g) {
          const float* sg = scale + g * kBlockN;
          const float* og = offset + g * kBlockN;
          group_product(xpad + m0 * K + g * G, K, w + g * G * kBlockN, G, part);
          for (int64_t m = 0; m < mc; ++m) {
            const __m512 xs = _mm512_set1_ps(xsum[(m0 + m) * groups + g]);
            for (int64_t j = 0; j < kBlockN; j += 16) {
              float* a = acc + m * kBlockN + j;
              const __m512 v = _mm512_fmadd_ps(_mm512_load_ps(part + m * kBlockN + j), _mm512_loadu_ps(sg + j), _mm512_load_ps(a));
              _mm512_store_ps(a, _mm512_fmadd_ps(xs, _mm512_loadu_ps(og + j), v));
            }
          }
        }
        for (int64_t m = 0; m < mc; ++m) {
          BF* o = yp + (m0 + m) * N + nb * kBlockN;
          for (int64_t j = 0; j < kBlockN; j += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * kBlockN + j)));
        }
      }
    }
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int4_amx_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("int4_amx_mm", &int4_amx_mm); }
#endif  // AVX512-BF16 + AVX512-VBMI + AMX-BF16
