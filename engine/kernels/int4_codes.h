// INT4 codes of torch's CPU int4pack layout (AVX512: 64-column blocks) as bf16 in VNNI order, for the
// engine's INT4 ops that multiply with bf16 dot products (int4_amx.cpp with AMX tiles, int4_avx512.cpp
// with vdpbf16ps). Each weight becomes 128 + code: an exact bf16 (bits 0x4300 | code: the exponent of
// 128, the code in the low mantissa bits), so the conversion is a byte interleave, a mask and an OR, with
// no float math per weight; the ops take the 128 back out with the group's offset (int4_block_scales).
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace morphserve {

constexpr int64_t kInt4BlockN = 64;  // the AVX512 int4pack layout's column block

// One 64-column block of the int4pack layout ([K][32] bytes: byte j holds column j in the low nibble,
// column 32 + j in the high one) -> bf16 (128 + code) in VNNI order [K/2][64][2].
inline void int4_codes_vnni(const uint8_t* blk, int64_t K, at::BFloat16* out) {
  alignas(64) uint8_t idx_arr[64];
  for (int j = 0; j < 32; ++j) idx_arr[2 * j] = j, idx_arr[2 * j + 1] = 64 + j;  // row k byte j, row k+1 byte j
  const __m512i idx = _mm512_load_si512(idx_arr), nib = _mm512_set1_epi8(0x0F), base = _mm512_set1_epi16(0x4300);
  for (int64_t k = 0; k < K; k += 2) {
    const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * 32)));
    const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (k + 1) * 32)));
    const __m512i t = _mm512_permutex2var_epi8(a, idx, b);              // byte pairs (row k, row k+1) of column j
    const __m512i lo = _mm512_and_si512(t, nib);                        // columns 0..31
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), nib);  // columns 32..63
    at::BFloat16* dst = out + (k / 2) * kInt4BlockN * 2;
    const __m256i parts[4] = {_mm512_castsi512_si256(lo), _mm512_extracti64x4_epi64(lo, 1),
                              _mm512_castsi512_si256(hi), _mm512_extracti64x4_epi64(hi, 1)};
    for (int q = 0; q < 4; ++q)  // columns 16q .. 16q + 15, as (row k, row k+1) bf16 pairs
      _mm512_storeu_si512(dst + 32 * q, _mm512_or_si512(_mm512_cvtepu8_epi16(parts[q]), base));
  }
}

// X_g[m] = sum_{k in g} x[m][k] for rows [0, M) of x (ld K), groups of G (a multiple of 16) -> out
// [M][K/G], fp32 sums of the bf16 inputs (the offset term of every group's share of y[m]).
inline void int4_group_sums(const at::BFloat16* x, int64_t M, int64_t K, int64_t G, float* out) {
  const int64_t groups = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc = _mm512_setzero_ps();
      const auto* row = reinterpret_cast<const uint16_t*>(x + m * K + g * G);
      for (int64_t k = 0; k < G; k += 16)  // 16 bf16 -> fp32, exact: bf16 is fp32's top half
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k))), 16)));
      out[m * groups + g] = _mm512_reduce_add_ps(acc);
    }
}

// The scales and offsets of one 64-column block for every group, from torch's [K/G, N, 2] (s, zp) bf16:
// w = code * s + (zp - 8 s) = (128 + code) * s + (zp - 136 s), so scale = s and offset = zp - 136 s
// ([groups][64] each), read once per block and applied to every row tile's group sums.
inline void int4_block_scales(const at::BFloat16* sz, int64_t N, int64_t nb, int64_t groups, float* scale, float* offset) {
  for (int64_t g = 0; g < groups; ++g) {
    const at::BFloat16* row = sz + (g * N + nb * kInt4BlockN) * 2;
    for (int64_t n = 0; n < kInt4BlockN; ++n) {
      const float s = static_cast<float>(row[2 * n]), zp = static_cast<float>(row[2 * n + 1]);
      scale[g * kInt4BlockN + n] = s;
      offset[g * kInt4BlockN + n] = zp - 136.f * s;
    }
  }
}

}  // namespace morphserve
#endif  // AVX512-BF16 + AVX512-VBMI
