// INT4 codes of torch's CPU int4pack layout (AVX512: 64-column blocks) as bf16 in VNNI order, for the
// engine's INT4 ops that multiply with bf16 dot products (int4_amx.cpp with AMX tiles, from a buffer;
// int4_avx512.cpp with vdpbf16ps, in registers). Each weight becomes 128 + code: an exact bf16 (bits
// 0x4300 | code: the exponent of 128, the code in the low mantissa bits), so the conversion is a byte
// interleave, a mask and an OR, with no float math per weight; the ops take the 128 back out with the
// group's offset (int4_block_scales).
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace morphserve {

constexpr int64_t kInt4BlockN = 64;  // the AVX512 int4pack layout's column block

// Two rows (k, k + 1) of one 64-column block of the int4pack layout ([K][32] bytes: byte j holds column
// j in the low nibble, column 32 + j in the high one), one 64-byte load -> bf16 (128 + code) in VNNI order:
// w[q] holds columns 16 q .. 16 q + 15 as (row k, row k + 1) pairs, vdpbf16ps's operand. A zero-masked byte
// permute puts column n's two bytes in the low bytes of words 2n and 2n + 1 (high bytes 0), so a mask or
// a shift, then the exponent, finish each 16 columns: two permutes and four logic ops per pair of rows
// (the first version: a two-source permute and four byte-to-word widenings).
struct Int4PairDecoder {
  __m512i lo_i, hi_i;  // byte indices of columns 0-15 and 16-31 (their high nibbles: 32-47, 48-63)
  __m512i nib = _mm512_set1_epi16(0x000F), base = _mm512_set1_epi16(0x4300);

  Int4PairDecoder() {
    alignas(64) uint8_t lo[64], hi[64];
    for (int w = 0; w < 32; ++w) {  // word w of the output = (column w / 2, row w % 2)
      lo[2 * w] = (w % 2) * 32 + w / 2, hi[2 * w] = (w % 2) * 32 + 16 + w / 2;
      lo[2 * w + 1] = hi[2 * w + 1] = 0;  // masked to zero
    }
    lo_i = _mm512_load_si512(lo), hi_i = _mm512_load_si512(hi);
  }

  void decode(const uint8_t* two_rows, __m512bh w[4]) const {
    constexpr __mmask64 kLowBytes = 0x5555555555555555ULL;
    const __m512i rows = _mm512_loadu_si512(two_rows);
    const __m512i p0 = _mm512_maskz_permutexvar_epi8(kLowBytes, lo_i, rows);
    const __m512i p1 = _mm512_maskz_permutexvar_epi8(kLowBytes, hi_i, rows);
    w[0] = (__m512bh)_mm512_ternarylogic_epi32(p0, nib, base, 0xEA);  // (p & 0xF) | 0x4300
    w[1] = (__m512bh)_mm512_ternarylogic_epi32(p1, nib, base, 0xEA);
    w[2] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(p0, 4), base);  // high nibbles
    w[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(p1, 4), base);
  }
};

// Rows [0, K) of one 64-column block -> bf16 (128 + code) in VNNI order [K/2][64][2] (for AMX's B tiles).
inline void int4_codes_vnni(const uint8_t* blk, int64_t K, at::BFloat16* out) {
  const Int4PairDecoder dec;
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh w[4];
    dec.decode(blk + k * 32, w);
    at::BFloat16* dst = out + (k / 2) * kInt4BlockN * 2;
    for (int q = 0; q < 4; ++q) _mm512_storeu_si512(dst + 32 * q, (__m512i)w[q]);
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
// ([groups][64] each), read once per block and applied to every row tile's group sums. A column's
// (s, zp) pair is one 32-bit word: s its low half, zp its high half, each a bf16 = an fp32's top half.
inline void int4_block_scales(const at::BFloat16* sz, int64_t N, int64_t nb, int64_t groups, float* scale, float* offset) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 c136 = _mm512_set1_ps(136.f);
  for (int64_t g = 0; g < groups; ++g) {
    const auto* pairs = reinterpret_cast<const int32_t*>(sz + (g * N + nb * kInt4BlockN) * 2);
    for (int64_t q = 0; q < kInt4BlockN / 16; ++q) {
      const __m512i v = _mm512_loadu_si512(pairs + 16 * q);
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 zp = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
      _mm512_storeu_ps(scale + g * kInt4BlockN + 16 * q, s);
      _mm512_storeu_ps(offset + g * kInt4BlockN + 16 * q, _mm512_fnmadd_ps(c136, s, zp));
    }
  }
}

}  // namespace morphserve
#endif  // AVX512-BF16 + AVX512-VBMI
