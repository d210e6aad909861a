// What the two bf16 linears over the vnni32 layout (bf16_amx.cpp, bf16_avx512.cpp) share: the layout's
// block width, the checks of a call's operands, writing a block's fp32 results out as bf16, and the
// brgemm route for many rows.
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
#include <optional>
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

// rows [0, rows) of c ([rows][32] fp32) + bias -> bf16 columns 32 nb .. of y (ld N): the output's only
// rounding, after the bias.
inline void vnni_store_rows(const float* c, int64_t rows, const float* bias, at::BFloat16* y, int64_t N) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(c + m * kVnniBlockN), b0);
    const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(c + m * kVnniBlockN + 16), b1);
    _mm512_storeu_si512(y + m * N, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
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

}  // namespace morphserve
#endif  // AVX512-BF16
