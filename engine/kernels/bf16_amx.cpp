// bf16 linear with AMX over weights pre-packed in VNNI blocks of 32 columns: y[M, N] = x[M, K] . W[N, K]^T (+ b).
//
//   packed layout: [N / 32][K / 2][32][2] bf16, i.e. block nb holds columns 32 nb .. 32 nb + 31 as
//   (k even, k odd) pairs: AMX's B operand for two 16-column tiles side by side (engine/layers/packed.py
//   makes it when a layer is loaded or restored).
//
// Why not oneDNN's packed linear (which this replaces where AMX exists): a decode step reads every weight
// once from memory, and oneDNN's blocked kernel streams them at 6-8 GB/s at 32 rows on this 2-core Xeon
// (30 layers' weights, 2 threads) where a plain read of the same bytes runs at 14 GB/s. Here each 32-column
// block is one contiguous run of K x 64 bytes, read once by one thread in order, with every cache line
// of it prefetched `kPrefetchSteps` k-steps ahead, for all rows of the step (up to 32: two 16-row tiles
// x two 16-column tiles, the 4 C tiles AMX has room for beside 2 A and 2 B tiles).
//
// More than 32 rows (prefill chunks): the weights are reused across row tiles, so the loop is a GEMM,
// not a stream (streaming each block once per 32 rows measured 1.2-1.4x oneDNN at 64-512 rows): ATen's brgemm (oneDNN's AMX micro-kernel, which takes this VNNI layout as its B) per
// (256-row chunk, 32-column block). Both routes accumulate each output in fp32 over k in order; the
// output is rounded to bf16 once, after the bias.
// Compiled only where the compiler targets AVX512-BF16 + AMX-BF16 (-march=native); elsewhere the op is
// not registered and packed layers keep oneDNN's layout.
#if defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "amx_tiles.h"
#include "bf16_vnni.h"

namespace {

using BF = at::BFloat16;
constexpr int64_t kBlockN = morphserve::kVnniBlockN;  // columns per packed block: two 16-column B tiles
constexpr int64_t kStreamRows = 32;     // up to this many rows the weights are streamed once
constexpr int64_t kPrefetchSteps = 8;   // k-steps (2 KB each) ahead; measured 4-32 all within noise

// Tiles 0-3: C (rows 0-15 | 16-31) x (columns 0-15 | 16-31); 4, 5: A (the two 16-row tiles); 6, 7: B.
void configure_tiles() {
  morphserve::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// c[32][32] fp32 = x rows [32] (zero-padded, ld K) . one packed block (K x 32).
void stream_block(const BF* x, int64_t K, const BF* w, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    const BF* b = w + k * kBlockN;  // 16 pair-rows x 32 columns x 2 = 2 KB, contiguous
    const char* ahead = reinterpret_cast<const char*>(b + kPrefetchSteps * 32 * kBlockN);
    for (int line = 0; line < 2048; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(4, x + k, K * sizeof(BF));
    _tile_loadd(5, x + 16 * K + k, K * sizeof(BF));
    _tile_loadd(6, b, kBlockN * 2 * sizeof(BF));       // columns 0-15 of each pair-row
    _tile_loadd(7, b + 32, kBlockN * 2 * sizeof(BF));  // columns 16-31
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, kBlockN * sizeof(float));
  _tile_stored(1, c + 16, kBlockN * sizeof(float));
  _tile_stored(2, c + 16 * kBlockN, kBlockN * sizeof(float));
  _tile_stored(3, c + 16 * kBlockN + 16, kBlockN * sizeof(float));
}

// M <= 32 rows: one pass over the weights.
void stream_rows(const BF* x, int64_t M, int64_t K, int64_t N, const BF* w, const float* bias, BF* y) {
  std::vector<uint16_t> xbuf(kStreamRows * K);  // 32 rows, the padding zero (AMX reads whole tiles)
  std::memcpy(xbuf.data(), x, M * K * sizeof(BF));
  const BF* xp = reinterpret_cast<const BF*>(xbuf.data());
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[kStreamRows * kBlockN];
    for (int64_t nb = begin; nb < end; ++nb) {
      stream_block(xp, K, w + nb * K * kBlockN, c);
      morphserve::vnni_store_rows(c, M, bias ? bias + nb * kBlockN : nullptr, y + nb * kBlockN, N);
    }
    _tile_release();
  });
}

at::Tensor bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const auto c = morphserve::vnni_call(x, packed, bias);
  TORCH_CHECK(morphserve::amx_permitted(), "the kernel did not grant AMX tile state (arch_prctl)");
  if (c.M == 0) return c.y;
  if (c.M <= kStreamRows)
    stream_rows(c.xp(), c.M, c.K, c.N, packed.data_ptr<BF>(), c.bp(), c.yp());
  else
    morphserve::vnni_gemm_rows(c.xp(), c.M, c.K, c.N, packed.data_ptr<BF>(), c.bp(), c.yp());
  return c.y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) { m.def("bf16_amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("bf16_amx_linear", &bf16_amx_linear); }
#endif  // AVX512-BF16 + AMX-BF16
