// INT4 x bf16 linear with AVX512-BF16 (no AMX), reading torch's CPU int4pack bytes (AVX512 layout:
// 64-column blocks; the bytes the host store keeps and Int4Linear holds, so swaps and the ledger are
// unchanged). The same arithmetic as int4_amx.cpp, with vdpbf16ps register tiles instead of AMX tiles:
//     y[m][n] = sum_g  s[g][n] * sum_{k in g} x[m][k] * (128 + code[k][n])  +  (b[g][n] - 128 s[g][n]) * X_g[m]
// (w = code * s + b, b = zp - 8 s: torch's int4pack convention; X_g[m] = sum_{k in g} x[m][k]).
//
// Why: on a CPU with AVX512-BF16 and no AMX (AMD Zen 4) torch's _weight_int4pack_mm_for_cpu made a
// decode step at 16 rows 1.22x (15 INT4 layers) and 1.46x (30) slower than the packed bf16 linears
// (bf16_avx512.cpp): it dequantizes each weight with float math on every call. Here each call turns a
// group's codes into bf16 (128 + code) once (int4_codes.h: byte permutes), into a buffer that stays in
// L1, and every row tile of the work item reuses them: R rows x 64 columns of fp32 partial sums per
// group, one broadcast of an (x[k], x[k+1]) pair per row and four vdpbf16ps per pair of k. Products are
// exact (bf16 x small integer) and each group's scale and offset are applied in fp32. A row's output
// depends only on its own row (batch-invariant). torch's kernel is kept below EngineConfig.int4_amx_min_rows
// rows (quant/dispatch.py), where decoding each call's codes costs more than it saves.
// Group by group, not block by block (the first version decoded a whole 64-column block, K x 128 B, into
// L2 and then ran the row tiles over it, and read the codes only when decoding them), with the codes
// two groups ahead prefetched inside the dot-product loop: 0.45-0.5x the bf16 linears' time at 1 row
// where that took 0.6-0.8x, 1.1x at 16 rows where that took 1.3-1.35x (SmolLM2's four shapes, 30
// copies, 2 threads, Zen 4). What is left at 16 rows is the decoding: the bf16 op is compute-bound
// there, and INT4 does the same dot products after decoding.
// Compiled only where the compiler targets AVX512-BF16 + AVX512-VBMI (-march=native).
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

#include "int4_codes.h"

namespace {

using BF = at::BFloat16;
using morphserve::kInt4BlockN;
constexpr int64_t kTileRows = 6;  // 6 rows x 4 column vectors = 24 accumulators + 4 weights + 1 broadcast
constexpr int64_t kPrefetchGroups = 2;  // 1 took 1.1x the time of 2 at 1 row, the same at 8-32
constexpr int64_t kChunkRows = 96;  // rows per work item: their fp32 sums (24 KB) stay in L1 beside the group's codes

// acc[R][64] += s_g * (x rows . codes of group g) + offset_g * X_g for rows [0, R) of x (ld K, starting at
// the group's first column). w: the group's codes, VNNI [G/2][64][2]; scale / offset: the group's [64];
// xsum: X_g of row 0 (the rows' sums are `groups` apart). `ahead` (or null): G * 32 bytes of codes to
// prefetch, one line per pair of k, so their read overlaps these dot products.
template <int R>
void tile(const BF* x, int64_t K, const BF* w, int64_t G, const float* scale, const float* offset,
          const float* xsum, int64_t groups, float* acc, const uint8_t* ahead) {
  const auto* xp = reinterpret_cast<const int32_t*>(x);  // one int32 = an (x[2p], x[2p + 1]) pair
  __m512 part[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) part[r][q] = _mm512_setzero_ps();
  for (int64_t p = 0; p < G / 2; ++p) {
    const BF* b = w + p * 2 * kInt4BlockN;
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + p * 64), _MM_HINT_T0);
    const auto w0 = (__m512bh)_mm512_load_si512(b), w1 = (__m512bh)_mm512_load_si512(b + 32);
    const auto w2 = (__m512bh)_mm512_load_si512(b + 64), w3 = (__m512bh)_mm512_load_si512(b + 96);
    for (int r = 0; r < R; ++r) {
      const auto a = (__m512bh)_mm512_set1_epi32(xp[r * (K / 2) + p]);
      part[r][0] = _mm512_dpbf16_ps(part[r][0], a, w0);
      part[r][1] = _mm512_dpbf16_ps(part[r][1], a, w1);
      part[r][2] = _mm512_dpbf16_ps(part[r][2], a, w2);
      part[r][3] = _mm512_dpbf16_ps(part[r][3], a, w3);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 xs = _mm512_set1_ps(xsum[r * groups]);
    for (int q = 0; q < 4; ++q) {
      float* a = acc + r * kInt4BlockN + 16 * q;
      const __m512 v = _mm512_fmadd_ps(part[r][q], _mm512_load_ps(scale + 16 * q), _mm512_load_ps(a));
      _mm512_store_ps(a, _mm512_fmadd_ps(xs, _mm512_load_ps(offset + 16 * q), v));
    }
  }
}

template <int... Rs>
void tile_rows(int64_t rows, const BF* x, int64_t K, const BF* w, int64_t G, const float* scale, const float* offset,
               const float* xsum, int64_t groups, float* acc, const uint8_t* ahead, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? (tile<Rs + 1>(x, K, w, G, scale, offset, xsum, groups, acc, ahead), 0) : 0), ...);
}

// 64-byte aligned scratch, freed on scope exit (a std::vector of BFloat16 would zero it element by element).
struct Scratch {
  explicit Scratch(int64_t bytes) : p(std::aligned_alloc(64, (bytes + 63) / 64 * 64)) { TORCH_CHECK(p, "out of memory"); }
  ~Scratch() { std::free(p); }
  template <typename T> T* as() const { return static_cast<T*>(p); }
  void* p;
};

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
  // Work items chunk-major, blocks in order (as bf16_avx512.cpp): a decode step splits the blocks between
  // the threads, each streaming its contiguous run of them.
  const int64_t blocks = N / kInt4BlockN, chunks = (M + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    const Scratch codes(G * kInt4BlockN * sizeof(BF)), scales(2 * groups * kInt4BlockN * sizeof(float));
    BF* w = codes.as<BF>();
    float* scale = scales.as<float>();  // [groups][64] scale, then offset
    float* offset = scale + groups * kInt4BlockN;
    alignas(64) float acc[kChunkRows * kInt4BlockN];
    int64_t scales_of = -1;  // the block `scales` holds
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = (i / blocks) * kChunkRows, nb = i % blocks, rows = std::min(kChunkRows, M - m0);
      if (scales_of != nb) morphserve::int4_block_scales(szp, N, nb, groups, scale, offset), scales_of = nb;
      std::fill(acc, acc + rows * kInt4BlockN, 0.f);
      const uint8_t* block = pp + nb * K * 32;
      for (int64_t g = 0; g < groups; ++g) {
        // Codes kPrefetchGroups groups on (maybe in the next block; near the end, the weight's last group),
        // read by the first row tile while it computes: decoding then finds them in cache.
        const uint8_t* ahead = pp + std::min(nb * K * 32 + (g + kPrefetchGroups) * G * 32, N * K / 2 - G * 32);
        morphserve::int4_codes_vnni(block + g * G * 32, G, w);
        for (int64_t r = 0; r < rows; r += kTileRows)
          tile_rows(std::min(kTileRows, rows - r), xp + (m0 + r) * K + g * G, K, w, G, scale + g * kInt4BlockN,
                    offset + g * kInt4BlockN, xsum.data() + (m0 + r) * groups + g, groups, acc + r * kInt4BlockN,
                    r == 0 ? ahead : nullptr, std::make_integer_sequence<int, kTileRows>{});
      }
      for (int64_t m = 0; m < rows; ++m) {
        BF* o = yp + (m0 + m) * N + nb * kInt4BlockN;
        for (int64_t j = 0; j < kInt4BlockN; j += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * kInt4BlockN + j)));
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
