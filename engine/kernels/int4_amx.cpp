// INT4 x bf16 linear with AMX, reading torch's CPU int4pack bytes (AVX512 layout: 64-column blocks; the
// bytes the host store keeps and Int4Linear holds, so swaps and the ledger are unchanged). Each 64-column
// block is dequantized into a per-thread bf16 VNNI buffer (K x 64 x 2 bytes, transient: allocated per call
// inside the parallel region, like any op's workspace; it is part of the activation reserve, not the
// weights) and multiplied with AMX through ATen's cpublas::brgemm (oneDNN ukernel), fp32 accumulation.
// Each output row depends only on its own input row (the same K order whatever the row count).
// torch's _weight_int4pack_mm_for_cpu has no AMX path; this one pays the dequantization once per call,
// so it wins from a few rows up (the engine dispatches by EngineConfig.int4_amx_min_rows, quant/int4_kernel.py).
// Compiled only where the compiler targets AVX512-BF16 + AMX-BF16 (-march=native); elsewhere the op is
// not registered and the engine keeps torch's kernel.
#if defined(__AVX512BF16__) && defined(__AMX_BF16__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <torch/library.h>
#include <vector>

namespace {

constexpr int64_t kBlockN = 64;   // the CPU int4pack layout's column block (AVX512)
constexpr int64_t kChunkM = 128;  // rows per brgemm call (bounds the fp32 accumulator)

// One 64-column block of the int4pack layout ([K][32] bytes: byte j holds column j in the low nibble,
// column 32 + j in the high one) -> bf16 in VNNI order [K/2][64][2], w = code * s + (zp - 8 s).
void dequant_block(const uint8_t* blk, const at::BFloat16* sz, int64_t n_total, int64_t n0, int64_t K,
                   int64_t G, at::BFloat16* out) {
  alignas(64) float scale[kBlockN], bias[kBlockN];
  const __m512i mask = _mm512_set1_epi32(0xF);
  alignas(64) int16_t idx_arr[32];
  for (int i = 0; i < 16; ++i) { idx_arr[2 * i] = i; idx_arr[2 * i + 1] = 16 + i; }
  const __m512i idx = _mm512_load_si512(idx_arr);
  for (int64_t k = 0; k < K; k += 2) {
    if (k % G == 0) {
      const at::BFloat16* row = sz + ((k / G) * n_total + n0) * 2;
      for (int64_t n = 0; n < kBlockN; ++n) {
        float s = static_cast<float>(row[2 * n]), zp = static_cast<float>(row[2 * n + 1]);
        scale[n] = s;
        bias[n] = zp - 8.0f * s;
      }
    }
    const uint8_t* r0 = blk + k * 32;
    const uint8_t* r1 = r0 + 32;
    for (int q = 0; q < 4; ++q) {  // columns 16q .. 16q + 15
      const int off = (q & 1) * 16, shift = (q >> 1) * 4;
      __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + off)));
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + off)));
      a = _mm512_and_si512(_mm512_srli_epi32(a, shift), mask);
      b = _mm512_and_si512(_mm512_srli_epi32(b, shift), mask);
      const __m512 s = _mm512_load_ps(scale + 16 * q), z = _mm512_load_ps(bias + 16 * q);
      const __m512 fa = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, z);
      const __m512 fb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), s, z);
      __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(fb, fa);  // [bf16(fa) x16, bf16(fb) x16]
      pair = _mm512_permutexvar_epi16(idx, pair);            // (fa[i], fb[i]) pairs: VNNI
      _mm512_storeu_si512(out + ((k / 2) * kBlockN + 16 * q) * 2, pair);
    }
  }
}

at::Tensor int4_amx_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& sz) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.is_contiguous(), "scales_and_zeros must be contiguous bf16 [K/G, N, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = sz.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == N * K / 2 && packed.is_contiguous(), "packed must be int4pack uint8 [N, K/2]");
  TORCH_CHECK(group_size > 0 && sz.size(0) * group_size == K, "x has ", K, " columns, the weight ", sz.size(0) * group_size);
  TORCH_CHECK(N % kBlockN == 0 && K % 2 == 0 && group_size % 2 == 0 && K % group_size == 0 && sz.size(0) == K / group_size, "unsupported shape");
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* pp = packed.data_ptr<uint8_t>();
  const auto* szp = sz.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> w(K * kBlockN);
    std::vector<float> acc(std::min(M, kChunkM) * kBlockN);
    for (int64_t nb = begin; nb < end; ++nb) {
      dequant_block(pp + nb * K * 32, szp, N, nb * kBlockN, K, group_size, w.data());
      for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
        const int64_t mc = std::min(kChunkM, M - m0);
        at::native::cpublas::brgemm(mc, kBlockN, K, K, kBlockN, kBlockN, false, xp + m0 * K, w.data(), acc.data());
        for (int64_t m = 0; m < mc; ++m) {
          const float* a = acc.data() + m * kBlockN;
          at::BFloat16* o = yp + (m0 + m) * N + nb * kBlockN;
          for (int64_t j = 0; j < kBlockN; j += 16) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + j)));
          }
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return y;
}


}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int4_amx_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("int4_amx_mm", &int4_amx_mm); }
#endif  // AVX512-BF16 + AMX-BF16
