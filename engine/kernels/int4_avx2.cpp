// INT4 x fp32 linear with AVX2 + FMA, reading torch's CPU int4pack bytes in their AVX2 layout
// (32-column blocks), the bytes the host store keeps and Int4Linear holds: swaps and the ledger are
// unchanged.
//
// Why: on a CPU without native bf16 the engine serves fp32, and torch's int4pack kernel has two routes
// there, both slow: bf16 activations (emulated: ~2x this op's time from 16 rows on an AVX2 EPYC) and
// fp32 activations (scalar, ~30x). Here a block's codes become floats once per call (exact, 0..15) in a
// chunk that stays in L1/L2, an FMA micro-kernel of up to 6 rows x 16 columns takes each group's dot
// products with them, and the group's scale and offset are applied to those sums (w = code * s + b,
// b = zp - 8 s: torch's int4pack convention), so per weight there is one conversion per call and one FMA
// per row. At 1-2 rows the codes are decoded in registers instead (no chunk to write and read back).
// Both routes do the same operations in the same order for every output, so a row's result depends only
// on its own input row, whatever the row count: INT4 layers are batch-invariant here.
// Scratch per thread: a [512, 32] fp32 chunk and the block's [K/G, 32] scales and offsets, well inside
// what memory_plan.int4_scratch_bytes reserves for the AMX op.
// Compiled where the compiler targets AVX2 + FMA (-march=native on such a CPU); elsewhere the op is not
// registered and INT4 layers keep torch's kernel.
#if defined(__AVX2__) && defined(__FMA__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlockN = 32;   // the AVX2 int4pack layout's column block: [K][16] bytes per block
constexpr int64_t kChunkK = 512;  // k values whose codes are turned into floats at once (a multiple of every group size)
constexpr int kRows = 6;          // micro-kernel rows: 6 x 2 partial sums + 2 codes + 1 input = 15 ymm
constexpr int kSmallRows = 4;     // up to this many rows the codes are decoded in registers, no chunk

// The 16 codes of k for columns [16 half, 16 half + 16) of a block, as two vectors of 8 floats.
inline void decode16(const uint8_t* blk, int64_t k, int half, __m256& c0, __m256& c1) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + k * 16));
  const __m128i nib = _mm_and_si128(half ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0F));
  c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib));
  c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(nib, 8)));
}

// c[k][32] = the codes of k in [k0, k0 + kc) of one block as floats (exact: 0..15).
void codes_chunk(const uint8_t* blk, int64_t k0, int64_t kc, float* c) {
  for (int64_t k = 0; k < kc; ++k)
    for (int half = 0; half < 2; ++half) {
      __m256 c0, c1;
      decode16(blk, k0 + k, half, c0, c1);
      _mm256_store_ps(c + k * kBlockN + 16 * half, c0);
      _mm256_store_ps(c + k * kBlockN + 16 * half + 8, c1);
    }
}

// y[R rows][16 columns] for the groups of k in [k0, k0 + kc): per group, the rows' dot products with the
// codes, then y = (y or 0) + part * s + X_g * b (w = code * s + b). The codes come from the chunk
// (`chunk`, columns already offset) or, kFromBytes, straight from the packed block: the same floats
// and the same operations in the same order either way, so a row's output does not depend on the route
// (nor on how many rows the call has).
template <int R, bool kFromBytes>
void micro(const float* x, int64_t ldx, const float* chunk, const uint8_t* blk, int half, int64_t k0, int64_t kc,
           int64_t G, const float* scale, const float* offset, const float* xsum, int64_t groups, float* y,
           int64_t ldy) {
  for (int64_t g0 = k0; g0 < k0 + kc; g0 += G) {
    __m256 part[R][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_ps();
    for (int64_t k = g0; k < g0 + G; ++k) {
      __m256 c0, c1;
      if constexpr (kFromBytes) {
        decode16(blk, k, half, c0, c1);
      } else {
        c0 = _mm256_load_ps(chunk + (k - k0) * kBlockN);
        c1 = _mm256_load_ps(chunk + (k - k0) * kBlockN + 8);
      }
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
        part[r][0] = _mm256_fmadd_ps(xv, c0, part[r][0]);
        part[r][1] = _mm256_fmadd_ps(xv, c1, part[r][1]);
      }
    }
    const int64_t g = g0 / G;
    const float* sg = scale + g * kBlockN;
    const float* og = offset + g * kBlockN;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_broadcast_ss(xsum + r * groups + g);
      for (int j = 0; j < 2; ++j) {
        const __m256 prev = g == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + 8 * j);
        const __m256 v = _mm256_fmadd_ps(part[r][j], _mm256_loadu_ps(sg + 8 * j), prev);
        _mm256_storeu_ps(y + r * ldy + 8 * j, _mm256_fmadd_ps(xs, _mm256_loadu_ps(og + 8 * j), v));
      }
    }
  }
}

using Micro = void (*)(const float*, int64_t, const float*, const uint8_t*, int, int64_t, int64_t, int64_t, const float*,
                       const float*, const float*, int64_t, float*, int64_t);
constexpr Micro kFromChunk[kRows + 1] = {nullptr, micro<1, false>, micro<2, false>, micro<3, false>,
                                         micro<4, false>, micro<5, false>, micro<6, false>};
constexpr Micro kFromBlock[kSmallRows + 1] = {nullptr, micro<1, true>, micro<2, true>, micro<3, true>, micro<4, true>};

// xsum[m][g] = the sum of x[m][k] over group g (the offset's multiplier), the same for any row count.
void group_sums(const float* x, int64_t M, int64_t K, int64_t G, float* xsum) {
  const int64_t groups = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float acc = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) acc += x[m * K + k];
      xsum[m * groups + g] = acc;
    }
}

at::Tensor int4_avx2_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& sz) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(2) == 2 && sz.is_contiguous(),
              "scales_and_zeros must be contiguous bf16 [K/G, N, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = sz.size(1), G = group_size;
  TORCH_CHECK(G > 0 && sz.size(0) * G == K, "x has ", K, " columns, the weight ", sz.size(0) * G);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == N * K / 2 && packed.is_contiguous(),
              "packed must be int4pack uint8 [N, K/2]");
  TORCH_CHECK(N % kBlockN == 0 && kChunkK % G == 0, "unsupported shape: N must be a multiple of 32 and the group size divide 512");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const auto* pp = packed.data_ptr<uint8_t>();
  const auto* szp = sz.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = K / G;
  std::vector<float> xsum(M * groups);
  group_sums(xp, M, K, G, xsum.data());
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scales(2 * groups * kBlockN);  // [groups][32] scale, then offset
    float* scale = scales.data();
    float* offset = scale + groups * kBlockN;
    std::vector<float> cbuf(M > kSmallRows ? std::min(K, kChunkK) * kBlockN + 8 : 0);
    float* chunk = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(cbuf.data()) + 31) & ~uintptr_t{31});
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t g = 0; g < groups; ++g) {
        const at::BFloat16* row = szp + (g * N + nb * kBlockN) * 2;
        for (int64_t n = 0; n < kBlockN; ++n) {
          const float s = static_cast<float>(row[2 * n]), zp = static_cast<float>(row[2 * n + 1]);
          scale[g * kBlockN + n] = s;
          offset[g * kBlockN + n] = zp - 8.f * s;
        }
      }
      const uint8_t* blk = pp + nb * K * (kBlockN / 2);
      float* yb = yp + nb * kBlockN;
      if (M <= kSmallRows) {
        for (int half = 0; half < 2; ++half)
          kFromBlock[M](xp, K, nullptr, blk, half, 0, K, G, scale + 16 * half, offset + 16 * half, xsum.data(), groups,
                        yb + 16 * half, N);
        continue;
      }
      for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
        const int64_t kc = std::min(kChunkK, K - k0);
        codes_chunk(blk, k0, kc, chunk);
        for (int64_t m0 = 0; m0 < M; m0 += kRows) {
          const int64_t r = std::min<int64_t>(kRows, M - m0);
          for (int half = 0; half < 2; ++half)
            kFromChunk[r](xp + m0 * K, K, chunk + 16 * half, blk, half, k0, kc, G, scale + 16 * half,
                          offset + 16 * half, xsum.data() + m0 * groups, groups, yb + m0 * N + 16 * half, N);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int4_avx2_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("int4_avx2_mm", &int4_avx2_mm); }
#endif  // AVX2 + FMA
