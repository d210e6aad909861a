// bf16 linear with AVX512-BF16 (no AMX) over the same vnni32-packed weights as bf16_amx.cpp:
// y[M, N] = x[M, K] . W[N, K]^T (+ b), packed layout [N / 32][K / 2][32][2] bf16 (engine/layers/packed.py).
//
// Why: on a CPU with AVX512-BF16 but no AMX (AMD Zen 4), oneDNN's packed bf16 linear read SmolLM2's 30
// layers' weights at ~13 GB/s at 1-8 rows (2 threads), where a plain read of the same bytes runs at
// 26-40 GB/s. Here one (k even, k odd) pair-row of a 32-column block is two zmm loads, and each row of x
// broadcasts its (x[2p], x[2p + 1]) pair into one vdpbf16ps per 16 columns: a decode step streams every
// block once, in order. Measured on a 2-core EPYC (30 layers' four weight shapes, distinct weights per
// layer, interleaved): 0.53-0.85x oneDNN's time at 1-32 rows, 0.83x at 64.
//
// Below kVnniGemmRows rows (bf16_vnni.h) the rows go in register tiles of up to kVnniTileRows (vnni_tiles:
// 2 x kVnniTileRows fp32 accumulators stay in registers); a block is re-read from L2 for each tile, and
// more than kChunkRows rows go in chunks so a chunk of x and a block of W both stay in L2. Every output is
// one fp32 sum over k in order, whatever the row count or the row's place in its tile (batch-invariant),
// rounded to bf16 once, after the bias.
// From kVnniGemmRows rows (prefill chunks) the weights are reused across many rows and ATen's brgemm runs.
// Compiled only where the compiler targets AVX512-BF16 (-march=native).
#if defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "bf16_vnni.h"

namespace {

using BF = at::BFloat16;
constexpr int64_t kBlockN = morphserve::kVnniBlockN;  // columns per packed block
constexpr int64_t kChunkRows = 96;  // rows per work item above one tile's worth (x chunk stays in L2)

at::Tensor bf16_avx512_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const auto c = morphserve::vnni_call(x, packed, bias);
  const int64_t M = c.M, K = c.K, N = c.N;
  if (M == 0) return c.y;
  const BF* xp = c.xp();
  const BF* wp = packed.data_ptr<BF>();
  const float* bp = c.bp();
  BF* yp = c.yp();
  if (M >= morphserve::kVnniGemmRows) {
    morphserve::vnni_gemm_rows(xp, M, K, N, wp, bp, yp);
    return c.y;
  }
  // Work items chunk-major, blocks in order: a decode step (one chunk) splits the blocks between the
  // threads, each streaming its contiguous run of them.
  const int64_t blocks = N / kBlockN, chunks = (M + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = (i / blocks) * kChunkRows, nb = i % blocks, m1 = std::min(M, m0 + kChunkRows);
      morphserve::vnni_tiles(xp, m0, m1, K, wp + nb * K * kBlockN, bp ? bp + nb * kBlockN : nullptr, nullptr,
                             yp + nb * kBlockN, N);
    }
  });
  return c.y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) { m.def("bf16_avx512_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("bf16_avx512_linear", &bf16_avx512_linear); }
#endif  // AVX512-BF16
