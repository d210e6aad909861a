// Benchmark candidate (ops/bench/quant_kernels.py --amx-candidate), not used by the engine: INT4 x bf16
// from torch's CPU int4pack bytes (the layout the host store keeps), each 64-column block dequantized
// into a thread-local bf16 VNNI buffer and multiplied with AMX through ATen's cpublas::brgemm.
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


// Codes only (exact small integers in bf16), VNNI [G/2][64][2], for the G rows from k0; scales applied after the GEMM.
void codes_group(const uint8_t* blk, int64_t k0, int64_t G, at::BFloat16* out) {
  static const __m512i lut = _mm512_set_epi16(0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
      0x4170,0x4160,0x4150,0x4140,0x4130,0x4120,0x4110,0x4100,0x40E0,0x40C0,0x40A0,0x4080,0x4040,0x4000,0x3F80,0x0000);
  alignas(64) int16_t i0[32], i1[32];
  for (int i = 0; i < 16; ++i) { i0[2*i] = i; i0[2*i+1] = 32 + i; i1[2*i] = 16 + i; i1[2*i+1] = 48 + i; }
  const __m512i idx0 = _mm512_load_si512(i0), idx1 = _mm512_load_si512(i1), mask = _mm512_set1_epi16(0xF);
  for (int64_t k = k0; k < k0 + G; k += 2) {
    __m512i a = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * 32)));
    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * 32 + 32)));
    __m512i alo = _mm512_permutexvar_epi16(_mm512_and_si512(a, mask), lut), ahi = _mm512_permutexvar_epi16(_mm512_srli_epi16(a, 4), lut);
    __m512i blo = _mm512_permutexvar_epi16(_mm512_and_si512(b, mask), lut), bhi = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);
    at::BFloat16* o = out + ((k - k0) / 2) * 128;
    _mm512_storeu_si512(o, _mm512_permutex2var_epi16(alo, idx0, blo));        // cols 0-15
    _mm512_storeu_si512(o + 32, _mm512_permutex2var_epi16(alo, idx1, blo));   // cols 16-31
    _mm512_storeu_si512(o + 64, _mm512_permutex2var_epi16(ahi, idx0, bhi));   // cols 32-47
    _mm512_storeu_si512(o + 96, _mm512_permutex2var_epi16(ahi, idx1, bhi));   // cols 48-63
  }
}

// Variant: exact integer codes through AMX per group, then y += s * (x . codes) + (zp - 8 s) * sum(x over the group).
at::Tensor int4_amx_codes_mm(const at::Tensor& x, const at::Tensor& packed, int64_t G, const at::Tensor& sz) {
  const int64_t M = x.size(0), K = x.size(1), N = sz.size(1), NG = K / G;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kByte && N % kBlockN == 0 && K % G == 0 && G % 2 == 0, "unsupported input");
  auto xc = x.contiguous();
  auto xsum = xc.view({M, NG, G}).sum(-1, false, at::kFloat).contiguous();  // [M, NG]
  auto szf = sz.to(at::kFloat).contiguous();  // [NG, N, 2]
  auto y = at::empty({M, N}, x.options());
  const auto* xp = xc.data_ptr<at::BFloat16>(); const auto* pp = packed.data_ptr<uint8_t>();
  const float* xs = xsum.data_ptr<float>(); const float* sf = szf.data_ptr<float>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> w(G * kBlockN);
    std::vector<float> acc(M * kBlockN), tot(M * kBlockN);
    for (int64_t nb = begin; nb < end; ++nb) {
      const uint8_t* blk = pp + nb * K * 32;
      std::fill(tot.begin(), tot.end(), 0.f);
      for (int64_t g = 0; g < NG; ++g) {
        codes_group(blk, g * G, G, w.data());
        at::native::cpublas::brgemm(M, kBlockN, G, K, kBlockN, kBlockN, false, xp + g * G, w.data(), acc.data());
        const float* s2 = sf + (g * N + nb * kBlockN) * 2;
        for (int64_t m = 0; m < M; ++m) {
          const float xg = xs[m * NG + g];
          for (int64_t j = 0; j < kBlockN; ++j) {
            const float s = s2[2 * j], bias = s2[2 * j + 1] - 8.f * s;
            tot[m * kBlockN + j] += s * acc[m * kBlockN + j] + bias * xg;
          }
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < kBlockN; j += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + m * N + nb * kBlockN + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tot.data() + m * kBlockN + j)));
    }
    at::native::cpublas::brgemm_release();
  });
  return y;
}


}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve_bench, m) {
  m.def("int4_amx_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) -> Tensor");
  m.def("int4_amx_codes_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve_bench, CPU, m) { m.impl("int4_amx_mm", &int4_amx_mm);
  m.impl("int4_amx_codes_mm", &int4_amx_codes_mm);
}
