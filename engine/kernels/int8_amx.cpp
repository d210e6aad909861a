// INT8 (weight-only, per-output-row scale) x bf16 linear with AMX-INT8, reading the host store's INT8 record
// as it is: qweight int8 [N, K] row-major, scales fp32 [N]; y[m, n] = s[n] * sum_k x[m, k] * q[n, k].
//
// No weight is ever converted: the int8 rows are AMX's A operand straight from memory (a tile is 16 weight
// rows x 64 k). The activations are what gets converted, once per call and M x K small: each row of x
// becomes v = round(x / xs[m]) with |v| <= 32512 (16-bit fixed point against the row's largest value) and
// v is split exactly into two int8 halves, v = 256 * hi + lo. Two TDPBSSD products (int8 x int8 -> int32,
// exact) give sum_k q * hi and sum_k q * lo, combined in fp32:
//
//   y[m, n] = (256 * C_hi[n][m] + C_lo[n][m]) * xs[m] * s[n]
//
// So the one approximation beyond bf16 output rounding is x on a 16-bit grid per row (an error of at most
// max|x[m]| / 65024 per element, below bf16's own rounding of x for every element above 1/128 of the row
// maximum); tests/test_int8_amx.py checks it against the exact product and the model's perplexity.
// The product is computed transposed (C = Q . X^T): B tiles are x's halves in VNNI order ([K/4][16] of
// 4-byte groups), built once per call, zero-padded to whole 16-row chunks. Threads split the output
// columns in blocks of 32 (two A tiles; C tiles: hi and lo for each). Each output row depends only on its
// own input row (its own scale, fixed k order), so the op is row-invariant.
// Compiled only where the compiler targets AVX512-BF16 + AMX-INT8 (-march=native); elsewhere the op is not
// registered and Int8Linear keeps torch's _weight_int8pack_mm.
#if defined(__AVX512BF16__) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <vector>

#include "amx_tiles.h"

namespace {

using morphserve::amx_permitted;
using morphserve::TileConfig;
using morphserve::load_bf16;

constexpr int64_t kTile = 16;           // rows of a tile (n rows of A / C, k quads of B)
constexpr int64_t kTileK = 64;          // int8 k values in one A tile row (64 bytes)
constexpr int64_t kBlockN = 2 * kTile;  // output columns per work item (two A tiles)
constexpr int32_t kXMax = 32512;        // |v| <= 32512 keeps hi = (v + 128) >> 8 within int8

// Tiles 0-3: C (n-tile a: hi at 2a, lo at 2a + 1); 4, 5: A (two n-tiles); 6, 7: B (hi, lo). All 16 x 64 B.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// One row of x -> v = round(x / xs) in [-kXMax, kXMax] as 256 * hi + lo (int8 each, exact); returns xs.
float split_row(const at::BFloat16* x, int64_t K, int8_t* hi, int8_t* lo) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16(x + k)));
  const float top = _mm512_reduce_max_ps(amax);
  const float xs = top > 0.0f ? top / kXMax : 1.0f;
  const __m512 inv = _mm512_set1_ps(1.0f / xs);
  const __m512i vmax = _mm512_set1_epi32(kXMax), vmin = _mm512_set1_epi32(-kXMax), half = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(x + k), inv));  // round to nearest
    v = _mm512_max_epi32(_mm512_min_epi32(v, vmax), vmin);                // x / xs may round past kXMax
    const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(v, half), 8);     // floor((v + 128) / 256)
    const __m512i l = _mm512_sub_epi32(v, _mm512_slli_epi32(h, 8));        // in [-128, 127]
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + k), _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + k), _mm512_cvtepi32_epi8(l));
  }
  return xs;
}

// x [M, K] -> B operands: hi and lo as [ceil(M/16)][K/4][16] 4-byte groups (zero rows past M), row scales.
struct SplitX {
  std::vector<uint32_t> hi, lo;
  std::vector<float> scale;
};

SplitX split_x(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t quads = K / 4, chunks = (M + kTile - 1) / kTile;
  SplitX out{std::vector<uint32_t>(chunks * quads * kTile, 0u), std::vector<uint32_t>(chunks * quads * kTile, 0u),
             std::vector<float>(M)};
  std::vector<uint32_t> hi_row(quads), lo_row(quads);
  for (int64_t m = 0; m < M; ++m) {
    out.scale[m] = split_row(x + m * K, K, reinterpret_cast<int8_t*>(hi_row.data()), reinterpret_cast<int8_t*>(lo_row.data()));
    const int64_t base = (m / kTile) * quads * kTile + m % kTile;
    for (int64_t i = 0; i < quads; ++i) {
      out.hi[base + i * kTile] = hi_row[i];
      out.lo[base + i * kTile] = lo_row[i];
    }
  }
  return out;
}

// One 16-row chunk of x against one block of 32 (or 16: ntiles = 1) weight rows, over all of K.
void accumulate(const int8_t* q, const uint32_t* hi, const uint32_t* lo, int64_t K, int64_t ntiles) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(6, hi + k / 4 * kTile, kTile * 4);
    _tile_loadd(7, lo + k / 4 * kTile, kTile * 4);
    _tile_loadd(4, q + k, K);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if (ntiles > 1) {
      _tile_loadd(5, q + kTile * K + k, K);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
}

// C tiles -> y rows m0 .. m0 + mrows: (256 hi + lo) * xs[m] * s[n], bf16.
void store_chunk(const float* xs, const float* s, int64_t m0, int64_t mrows, int64_t N, int64_t n0, int64_t ntiles,
                 at::BFloat16* y) {
  alignas(64) int32_t c[4][kTile * kTile];
  _tile_stored(0, c[0], kTile * 4);
  _tile_stored(1, c[1], kTile * 4);
  _tile_stored(2, c[2], kTile * 4);
  _tile_stored(3, c[3], kTile * 4);
  const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(kTile));  // C[i][m] sits at i * 16 + m
  for (int64_t a = 0; a < ntiles; ++a) {
    const __m512 scale = _mm512_loadu_ps(s + n0 + a * kTile);
    for (int64_t m = 0; m < mrows; ++m) {
      const __m512 h = _mm512_cvtepi32_ps(_mm512_i32gather_epi32(col, c[2 * a] + m, 4));
      const __m512 l = _mm512_cvtepi32_ps(_mm512_i32gather_epi32(col, c[2 * a + 1] + m, 4));
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_fmadd_ps(h, _mm512_set1_ps(256.0f), l), _mm512_set1_ps(xs[m0 + m])), scale);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * N + n0 + a * kTile), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

at::Tensor int8_amx_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "qweight must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, "x has ", K, " columns, the weight ", qweight.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous(), "scales must be contiguous fp32 [N]");
  TORCH_CHECK(N % kTile == 0 && K % kTileK == 0, "int8_amx_mm needs N % 16 == 0 and K % 64 == 0, got N=", N, " K=", K);
  TORCH_CHECK(amx_permitted(), "the kernel did not grant AMX tile state (arch_prctl)");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xc = x.contiguous();
  const SplitX sx = split_x(xc.data_ptr<at::BFloat16>(), M, K);
  const int64_t chunk_elems = K / 4 * kTile;
  const auto* qp = qweight.data_ptr<int8_t>();
  const auto* sp = scales.data_ptr<float>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, (N + kBlockN - 1) / kBlockN, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kBlockN, ntiles = std::min(kBlockN, N - n0) / kTile;
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {  // the block's weight rows stay in cache across chunks
        accumulate(qp + n0 * K, sx.hi.data() + m0 / kTile * chunk_elems, sx.lo.data() + m0 / kTile * chunk_elems, K, ntiles);
        store_chunk(sx.scale.data(), sp, m0, std::min(kTile, M - m0), N, n0, ntiles, yp);
      }
    }
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) { m.def("int8_amx_mm(Tensor x, Tensor qweight, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("int8_amx_mm", &int8_amx_mm); }
#endif  // AVX512-BF16 + AMX-INT8
