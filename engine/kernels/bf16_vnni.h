// What the linears over the vnni32 layout share: the layout's block width, the checks of a call's operands,
// writing a block's fp32 results out as bf16, the register tiles for fewer than kVnniGemmRows rows and the
// brgemm routes from there. Users: the two bf16 linears (bf16_amx.cpp, bf16_avx512.cpp) on packed weights;
// the INT4 / INT8 AVX512 ops (int4_avx512.cpp, int8_avx512.cpp) on weights they convert block by block.
//   packed layout: [N / 32][K / 2][32][2] bf16 (engine/layers/packed.py): block nb holds columns
//   32 nb .. 32 nb + 31 as (k even, k odd) pairs, which is both AMX's B operand and vdpbf16ps's.
#pragma once
#if defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace morphserve {

constexpr int64_t kVnniBlockN = 32;      // columns per packed block
constexpr int64_t kVnniGemmChunk = 256;  // rows per brgemm call (the x chunk stays in L2)
// From this many rows (prefill chunks) the AVX512-BF16 linears (bf16_avx512.cpp, and int4_avx512.cpp on
// its dequantized weight) take brgemm: 0.95-0.98x oneDNN's time at 256-4,096 rows on a 2-core EPYC where
// register tiles took 1.03-1.06x. Below it their outputs are row-invariant.
constexpr int64_t kVnniGemmRows = 256;

// One call's operands, checked: x contiguous, the bias as fp32 (undefined when there is none), y allocated.
struct VnniCall {
  int64_t M, K, N;
  at::Tensor x, bias, y;
  const at::BFloat16* xp() const { return x.data_ptr<at::BFloat16>(); }
  const float* bp() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  at::BFloat16* yp() const { return y.data_ptr<at::BFloat16>(); }
};

inline VnniCall vnni_call(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be bf16 [M, K] on the CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kVnniBlockN && packed.size(3) == 2,
              "packed must be contiguous bf16 [N/32, K/2, 32, 2] (engine/layers/packed.py)");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kVnniBlockN;
  TORCH_CHECK(packed.size(1) * 2 == K, "x has ", K, " columns, the packed weight ", packed.size(1) * 2);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got ", K);
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [", N, "]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  return {M, K, N, x.contiguous(), b32, at::empty({M, N}, x.options())};
}

// rows [0, rows) of c ([rows][32] fp32) x the columns' scale (INT8 weights; null: 1) + bias -> bf16 columns
// 32 nb .. of y (ld N): the output's only rounding, after the bias.
inline void vnni_store_rows(const float* c, int64_t rows, const float* bias, at::BFloat16* y, int64_t N,
                            const float* scale = nullptr) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  const __m512 s0 = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.f);
  const __m512 s1 = scale ? _mm512_loadu_ps(scale + 16) : _mm512_set1_ps(1.f);
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 lo = _mm512_fmadd_ps(_mm512_loadu_ps(c + m * kVnniBlockN), s0, b0);
    const __m512 hi = _mm512_fmadd_ps(_mm512_loadu_ps(c + m * kVnniBlockN + 16), s1, b1);
    _mm512_storeu_si512(y + m * N, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

constexpr int64_t kVnniTileRows = 12;      // rows per register tile: 24 accumulators + 2 weights + 1 broadcast
constexpr int64_t kVnniPrefetchPairs = 16;  // pair-rows (128 B each) ahead

// c[R][32] fp32 = rows [0, R) of x (ld K) . one packed block (K/2 pair-rows x 32 columns x 2).
template <int R>
void vnni_tile(const at::BFloat16* x, int64_t K, const at::BFloat16* w, float* c) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const auto* xp = reinterpret_cast<const int32_t*>(x);  // one int32 = an (x[2p], x[2p + 1]) pair
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const at::BFloat16* b = w + p * 2 * kVnniBlockN;
    _mm_prefetch(reinterpret_cast<const char*>(b + kVnniPrefetchPairs * 2 * kVnniBlockN), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + (kVnniPrefetchPairs * 2 + 1) * kVnniBlockN), _MM_HINT_T0);
    const auto w0 = (__m512bh)_mm512_loadu_si512(b);                // columns 0-15 of this pair-row
    const auto w1 = (__m512bh)_mm512_loadu_si512(b + kVnniBlockN);  // columns 16-31
    for (int r = 0; r < R; ++r) {
      const auto a = (__m512bh)_mm512_set1_epi32(xp[r * pairs + p]);
      lo[r] = _mm512_dpbf16_ps(lo[r], a, w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], a, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * kVnniBlockN, lo[r]);
    _mm512_storeu_ps(c + r * kVnniBlockN + 16, hi[r]);
  }
}

template <int... Rs>
void vnni_tile_rows(const at::BFloat16* x, int64_t rows, int64_t K, const at::BFloat16* w, float* c,
                    std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? (vnni_tile<Rs + 1>(x, K, w, c), 0) : 0), ...);
}

// Rows [m0, m1) of x . one packed block w -> y's columns of that block (y: the block's first column, ld N),
// in register tiles of up to kVnniTileRows rows. Every output is one fp32 sum over k in order, whatever the
// row count or the row's place in its tile (row-invariant), then scale, bias and one rounding to bf16.
inline void vnni_tiles(const at::BFloat16* x, int64_t m0, int64_t m1, int64_t K, const at::BFloat16* w,
                       const float* bias, const float* scale, at::BFloat16* y, int64_t N) {
  alignas(64) float acc[kVnniTileRows * kVnniBlockN];
  for (int64_t m = m0; m < m1; m += kVnniTileRows) {
    const int64_t rows = std::min(kVnniTileRows, m1 - m);
    vnni_tile_rows(x + m * K, rows, K, w, acc, std::make_integer_sequence<int, kVnniTileRows>{});
    vnni_store_rows(acc, rows, bias, y + m * N, N, scale);
  }
}

// y = x . W^T (+ bias) through ATen's brgemm (oneDNN's micro-kernel: AMX where the CPU has it, else
// AVX512-BF16; it takes the vnni32 layout as its B), one call per (256-row chunk, block).
inline void vnni_gemm_rows(const at::BFloat16* x, int64_t M, int64_t K, int64_t N, const at::BFloat16* w,
                           const float* bias, at::BFloat16* y) {
  const int64_t blocks = N / kVnniBlockN, chunks = (M + kVnniGemmChunk - 1) / kVnniGemmChunk;
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(kVnniGemmChunk * kVnniBlockN);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = (i / blocks) * kVnniGemmChunk, nb = i % blocks, rows = std::min(kVnniGemmChunk, M - m0);
      at::native::cpublas::brgemm(rows, kVnniBlockN, K, K, kVnniBlockN, kVnniBlockN, false, x + m0 * K,
                                  w + nb * K * kVnniBlockN, c.data());
      vnni_store_rows(c.data(), rows, bias ? bias + nb * kVnniBlockN : nullptr, y + m0 * N + nb * kVnniBlockN, N);
    }
    at::native::cpublas::brgemm_release();
  });
}

// y = x . W^T for a weight stored in another format (INT4, INT8), from kVnniGemmRows rows: each thread fills
// one 32-column block at a time in the vnni32 layout into an L2-sized buffer (`make_filler()` gives each
// thread a callable fill(block, out)) and runs brgemm on it for every kVnniGemmChunk-row chunk of x, so no
// bf16 copy of the whole weight is ever made; `scale` (or null): a factor per output column (INT8's).
template <typename MakeFiller>
inline void vnni_gemm_filled(const at::BFloat16* x, int64_t M, int64_t K, int64_t N, const MakeFiller& make_filler,
                             at::BFloat16* y, const float* scale = nullptr) {
  at::parallel_for(0, N / kVnniBlockN, 1, [&](int64_t begin, int64_t end) {
    auto fill = make_filler();
    const std::unique_ptr<at::BFloat16[]> w(new at::BFloat16[K * kVnniBlockN]);  // written in full by fill
    std::vector<float> c(kVnniGemmChunk * kVnniBlockN);
    for (int64_t b = begin; b < end; ++b) {
      fill(b, w.get());
      for (int64_t m0 = 0; m0 < M; m0 += kVnniGemmChunk) {
        const int64_t rows = std::min(kVnniGemmChunk, M - m0);
        at::native::cpublas::brgemm(rows, kVnniBlockN, K, K, kVnniBlockN, kVnniBlockN, false, x + m0 * K, w.get(),
                                    c.data());
        vnni_store_rows(c.data(), rows, nullptr, y + m0 * N + b * kVnniBlockN, N,
                        scale ? scale + b * kVnniBlockN : nullptr);
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

// Every 32-column block of such a weight filled into `out` ([N/32][K/2][32][2]) with the same fillers, the
// blocks split over the threads: the converted weight itself, for tests and tools.
template <typename MakeFiller>
inline void vnni_fill_all(int64_t K, int64_t N, const MakeFiller& make_filler, at::BFloat16* out) {
  at::parallel_for(0, N / kVnniBlockN, 1, [&](int64_t begin, int64_t end) {
    auto fill = make_filler();
    for (int64_t b = begin; b < end; ++b) fill(b, out + b * K * kVnniBlockN);
  });
}

}  // namespace morphserve
#endif  // AVX512-BF16
