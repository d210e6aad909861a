// INT4 x bf16 linear with AVX512-BF16 (no AMX), reading torch's CPU int4pack bytes (AVX512 layout:
// 64-column blocks; the bytes the host store keeps and Int4Linear holds, so swaps and the ledger are
// unchanged). The same arithmetic as int4_amx.cpp, with vdpbf16ps register tiles instead of AMX tiles:
//     y[m][n] = sum_g  s[g][n] * sum_{k in g} x[m][k] * (128 + code[k][n])  +  (b[g][n] - 128 s[g][n]) * X_g[m]
// (w = code * s + b, b = zp - 8 s: torch's int4pack convention; X_g[m] = sum_{k in g} x[m][k]).
//
// Why: on a CPU with AVX512-BF16 and no AMX (AMD Zen 4) torch's _weight_int4pack_mm_for_cpu made a
// decode step at 16 rows 1.22x (15 INT4 layers) and 1.46x (30) slower than the packed bf16 linears
// (bf16_avx512.cpp): it dequantizes each weight with float math on every call. Here each call turns a
// block's codes into bf16 (128 + code) once (int4_codes.h: byte shuffles), and every row tile reuses
// them from L2: R rows x 64 columns of fp32 accumulators per group, one broadcast of an (x[k], x[k+1])
// pair per row and four vdpbf16ps per pair of k. Products are exact (bf16 x small integer) and each
// group's scale and offset are applied in fp32. A row's output depends only on its own row (batch-
// invariant). torch's kernel is kept below EngineConfig.int4_amx_min_rows rows (quant/dispatch.py),
// where decoding each call's codes costs more than it saves.
// Compiled only where the compiler targets AVX512-BF16 + AVX512-VBMI (-march=native).
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "int4_codes.h"

namespace {

using BF = at::BFloat16;
using morphserve::kInt4BlockN;
constexpr int64_t kTileRows = 6;  // 6 rows x 4 column vectors = 24 accumulators + 4 weights + 1 broadcast

// acc[R][64] += per group g: s_g * (x rows . codes of g) + offset_g * X_g, for rows [0, R) of x (ld K).
// w: the block's codes, VNNI [K/2][64][2]; scale / offset: [groups][64]; xsum: [rows][groups].
template <int R>
void tile(const BF* x, int64_t K, const BF* w, int64_t G, const float* scale, const float* offset,
          const float* xsum, float* acc) {
  const int64_t groups = K / G;
  const auto* xp = reinterpret_cast<const int32_t*>(x);  // one int32 = an (x[2p], x[2p + 1]) pair
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][4];
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < 4; ++q) part[r][q] = _mm512_setzero_ps();
    for (int64_t p = g * G / 2; p < (g + 1) * G / 2; ++p) {
      const BF* b = w + p * 2 * kInt4BlockN;
      const auto w0 = (__m512bh)_mm512_loadu_si512(b), w1 = (__m512bh)_mm512_loadu_si512(b + 32);
      const auto w2 = (__m512bh)_mm512_loadu_si512(b + 64), w3 = (__m512bh)_mm512_loadu_si512(b + 96);
      for (int r = 0; r < R; ++r) {
        const auto a = (__m512bh)_mm512_set1_epi32(xp[r * (K / 2) + p]);
        part[r][0] = _mm512_dpbf16_ps(part[r][0], a, w0);
        part[r][1] = _mm512_dpbf16_ps(part[r][1], a, w1);
        part[r][2] = _mm512_dpbf16_ps(part[r][2], a, w2);
        part[r][3] = _mm512_dpbf16_ps(part[r][3], a, w3);
      }
    }
    const float* sg = scale + g * kInt4BlockN;
    const float* og = offset + g * kInt4BlockN;
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(xsum[r * groups + g]);
      for (int q = 0; q < 4; ++q) {
        float* a = acc + r * kInt4BlockN + 16 * q;
        const __m512 v = _mm512_fmadd_ps(part[r][q], _mm512_loadu_ps(sg + 16 * q), _mm512_loadu_ps(a));
        _mm512_storeu_ps(a, _mm512_fmadd_ps(xs, _mm512_loadu_ps(og + 16 * q), v));
      }
    }
  }
}

template <int... Rs>
void tile_rows(int64_t rows, const BF* x, int64_t K, const BF* w, int64_t G, const float* scale, const float* offset,
               const float* xsum, float* acc, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? (tile<Rs + 1>(x, K, w, G, scale, offset, xsum, acc), 0) : 0), ...);
}

at::Tensor int4_avx512_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& sz) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be bf16 [M, K] on the CPU");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(2) == 2 && sz.is_contiguous(),
              "scales_and_zeros must be contiguous bf16 [K/G, N, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = sz.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == N * K / 2 && packed.is_contiguous(),
              "packed must be int4pack uint8 [N, K/2]");
  TORCH_CHECK(group_size > 0 && sz.size(0) * group_size == K, "x has ", K, " columns, the weight ", sz.size(0) * group_size);
  TORCH_CHECK(N % kInt4BlockN == 0 && group_size % 16 == 0,
              "unsupported shape: N must be a multiple of 64, the group size a multiple of 16");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t G = group_size, groups = K / G;
  const auto xc = x.contiguous();
  const BF* xp = xc.data_ptr<BF>();
  std::vector<float> xsum(M * groups);  // X_g[m]
  morphserve::int4_group_sums(xp, M, K, G, xsum.data());
  const auto* pp = packed.data_ptr<uint8_t>();
  const auto* szp = sz.data_ptr<BF>();
  auto* yp = y.data_ptr<BF>();
  at::parallel_for(0, N / kInt4BlockN, 1, [&](int64_t begin, int64_t end) {
    // uint16_t, not BF: a vector<BFloat16> is zeroed one element at a time.
    std::vector<uint16_t> wbuf(K * kInt4BlockN);
    BF* w = reinterpret_cast<BF*>(wbuf.data());
    std::vector<float> scales(2 * groups * kInt4BlockN);  // [groups][64] scale, then offset
    float* scale = scales.data();
    float* offset = scale + groups * kInt4BlockN;
    alignas(64) float acc[kTileRows * kInt4BlockN];
    for (int64_t nb = begin; nb < end; ++nb) {
      morphserve::int4_codes_vnni(pp + nb * K * 32, K, w);
      morphserve::int4_block_scales(szp, N, nb, groups, scale, offset);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {  // the block's codes stay in L2 across row tiles
        const int64_t rows = std::min(kTileRows, M - m0);
        std::fill(acc, acc + rows * kInt4BlockN, 0.f);
        tile_rows(rows, xp + m0 * K, K, w, G, scale, offset, xsum.data() + m0 * groups, acc,
                  std::make_integer_sequence<int, kTileRows>{});
        for (int64_t m = 0; m < rows; ++m) {
          BF* o = yp + (m0 + m) * N + nb * kInt4BlockN;
          for (int64_t j = 0; j < kInt4BlockN; j += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * kInt4BlockN + j)));
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int4_avx512_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("int4_avx512_mm", &int4_avx512_mm); }
#endif  // AVX512-BF16 + AVX512-VBMI
