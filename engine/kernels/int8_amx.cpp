// INT8 (weight-only, per-output-row scale) x bf16 linear with AMX, reading the host store's INT8 record as
// it is: qweight int8 [N, K] row-major, scales fp32 [N]; y[m, n] = s[n] * sum_k x[m, k] * q[n, k].
//
// The product is computed transposed, Y^T = Q . X^T, so the weight is AMX's A operand: a tile of A is 16
// weight rows x 32 k, a plain row-major slab, and dequantizing is an elementwise int8 -> bf16 conversion
// (exact: |q| <= 127 fits bf16's 8-bit significand) with no transposition of the weight. X^T is the B
// operand in VNNI order, built once per call (a transposition of x viewed as [M, K/2] 32-bit pairs,
// zero-padded to whole 16-row chunks). The scale multiplies the fp32 accumulator, so the only roundings
// are AMX's fp32 accumulation and the final bf16 of y.
//
//   C tile [16 n x 16 m] fp32  +=  A [16 n x 32 k] bf16  .  B [16 k-pairs x 16 m x 2] bf16
//
// Threads split the output columns in blocks of 32 (two A tiles); each block is dequantized once into a
// per-thread buffer ([32][K] bf16, transient workspace, part of the activation reserve) and multiplied
// with every 32-row chunk of x (2 x 2 C tiles). Each output row depends only on its own input row: the k
// order is fixed and padding rows are zeros, so the op is row-invariant.
// Compiled only where the compiler targets AVX512-BF16 + AMX-BF16 (-march=native); elsewhere the op is
// not registered and Int8Linear keeps torch's _weight_int8pack_mm.
#if defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTile = 16;          // rows of a tile (n rows of A / C, k pairs of B)
constexpr int64_t kTileK = 32;         // bf16 k values in one A tile row (64 bytes)
constexpr int64_t kBlockN = 2 * kTile;  // output columns per work item (two A tiles)
constexpr int64_t kChunkM = 2 * kTile;  // activation rows per pass (two B tiles)
constexpr int64_t kSliceK = 256;       // k per dequantized slice when one pass covers x (32 x 256 bf16 = 16 KiB)

// Linux hands AMX tile state to a process only on request (arch_prctl); once per process.
bool amx_permitted() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (n-tile a, m-tile b) at 2a + b; 4, 5: A (two n-tiles); 6, 7: B (two m-tiles). All 16 x 64 B.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// x [M, K] bf16 -> VNNI B operand [ceil(M/16)][K/2][16] of 32-bit (x[m, 2i], x[m, 2i + 1]) pairs, zero rows
// past M.
std::vector<uint32_t> transpose_x(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t pairs = K / 2, chunks = (M + kTile - 1) / kTile;
  std::vector<uint32_t> xt(chunks * pairs * kTile, 0u);
  for (int64_t m = 0; m < M; ++m) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(x + m * K);
    uint32_t* dst = xt.data() + (m / kTile) * pairs * kTile + (m % kTile);
    for (int64_t i = 0; i < pairs; ++i) dst[i * kTile] = row[i];
  }
  return xt;
}

// len int8 codes -> bf16 (the codes themselves, exact); len % 32 == 0.
void dequant_row(const int8_t* src, int64_t len, at::BFloat16* dst) {
  for (int64_t k = 0; k < len; k += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 16))));
    _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// C tile (n-tile rows, m columns) -> y[m, n0 + i] = bf16(C[i][m] * s[n0 + i]) for the rows that exist.
void store_tile(const float* c, const float* s, int64_t m0, int64_t mrows, int64_t N, int64_t n0, at::BFloat16* y) {
  const __m512 scale = _mm512_loadu_ps(s + n0);
  const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(kTile));
  for (int64_t m = 0; m < mrows; ++m) {
    const __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(col, c + m, 4), scale);  // column m of C
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * N + n0), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// The B tiles of the 32-row chunk of x at m0 (the second one unused past M).
struct XChunk {
  const uint32_t* b0;
  const uint32_t* b1;
  int64_t mtiles;
};

XChunk x_chunk(const uint32_t* xt, int64_t M, int64_t K, int64_t m0) {
  const int64_t pairs = K / 2;
  const uint32_t* b0 = xt + (m0 / kTile) * pairs * kTile;
  return {b0, b0 + pairs * kTile, std::min<int64_t>(2, (M - m0 + kTile - 1) / kTile)};
}

// C += A . B over k in [k0, k0 + len): A = dequantized rows w (row stride lda bf16, column 0 = k0).
void accumulate(const at::BFloat16* w, int64_t lda, const XChunk& xc, int64_t k0, int64_t len, int64_t ntiles) {
  const int64_t b_stride = kTile * 4;
  for (int64_t k = 0; k < len; k += kTileK) {
    const int64_t kp = (k0 + k) / 2;
    _tile_loadd(6, xc.b0 + kp * kTile, b_stride);
    _tile_loadd(4, w + k, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    if (ntiles > 1) {
      _tile_loadd(5, w + kTile * lda + k, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (xc.mtiles > 1) {
      _tile_loadd(7, xc.b1 + kp * kTile, b_stride);
      _tile_dpbf16ps(1, 4, 7);
      if (ntiles > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// The C tiles -> y rows m0.. (scaled, bf16); cbuf: 4 tiles of [16][16] fp32 at (2a + b) * 256.
void store_block(float* cbuf, const float* s, int64_t M, int64_t N, int64_t n0, int64_t ntiles, int64_t m0,
                 int64_t mtiles, at::BFloat16* y) {
  _tile_stored(0, cbuf, kTile * 4);
  _tile_stored(1, cbuf + 256, kTile * 4);
  _tile_stored(2, cbuf + 512, kTile * 4);
  _tile_stored(3, cbuf + 768, kTile * 4);
  for (int64_t a = 0; a < ntiles; ++a) {
    for (int64_t b = 0; b < mtiles; ++b) {
      const int64_t mb = m0 + b * kTile;
      store_tile(cbuf + (2 * a + b) * 256, s, mb, std::min<int64_t>(kTile, M - mb), N, n0 + a * kTile, y);
    }
  }
}

void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Prefetch `bytes` from p into L2, spread over calls: part i of parts.
void prefetch_part(const int8_t* p, int64_t bytes, int64_t i, int64_t parts) {
  const int64_t per = (bytes + parts - 1) / parts;
  for (int64_t o = i * per; o < std::min(bytes, (i + 1) * per); o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}

// One block of 32 output columns (two n-tiles; `ntiles` may be 1 at the end) for all M rows. `next`: the
// weight rows of the thread's next block (prefetched while this one computes), or null.
void block_mm(const int8_t* q, const int8_t* next, const uint32_t* xt, const float* s, int64_t M, int64_t K,
              int64_t N, int64_t n0, int64_t ntiles, at::BFloat16* w, float* cbuf, at::BFloat16* y) {
  const int64_t rows = ntiles * kTile, next_bytes = next ? kBlockN * K : 0;
  if (M <= kChunkM) {  // decode: one pass over k, dequantizing slices into an L1-resident buffer
    const XChunk xc = x_chunk(xt, M, K, 0);
    const int64_t slices = (K + kSliceK - 1) / kSliceK;
    zero_c();
    for (int64_t i = 0; i < slices; ++i) {
      const int64_t k0 = i * kSliceK, len = std::min(kSliceK, K - k0);
      prefetch_part(next, next_bytes, i, slices);
      for (int64_t r = 0; r < rows; ++r) dequant_row(q + r * K + k0, len, w + r * kSliceK);
      accumulate(w, kSliceK, xc, k0, len, ntiles);
    }
    store_block(cbuf, s, M, N, n0, ntiles, 0, xc.mtiles, y);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) dequant_row(q + r * K, K, w + r * K);  // prefill: dequantize once, reuse per chunk
  const int64_t chunks = (M + kChunkM - 1) / kChunkM;
  for (int64_t c = 0; c < chunks; ++c) {
    const XChunk xc = x_chunk(xt, M, K, c * kChunkM);
    prefetch_part(next, next_bytes, c, chunks);
    zero_c();
    accumulate(w, K, xc, 0, K, ntiles);
    store_block(cbuf, s, M, N, n0, ntiles, c * kChunkM, xc.mtiles, y);
  }
}

at::Tensor int8_amx_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "qweight must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, "x has ", K, " columns, the weight ", qweight.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous(), "scales must be contiguous fp32 [N]");
  TORCH_CHECK(N % kTile == 0 && K % kTileK == 0, "int8_amx_mm needs N % 16 == 0 and K % 32 == 0, got N=", N, " K=", K);
  TORCH_CHECK(amx_permitted(), "the kernel did not grant AMX tile state (arch_prctl)");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xc = x.contiguous();
  const std::vector<uint32_t> xt = transpose_x(xc.data_ptr<at::BFloat16>(), M, K);
  const auto* qp = qweight.data_ptr<int8_t>();
  const auto* sp = scales.data_ptr<float>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, (N + kBlockN - 1) / kBlockN, 1, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> w(kBlockN * (M <= kChunkM ? kSliceK : K));
    alignas(64) float cbuf[4 * 256];
    configure_tiles();
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kBlockN, rows = std::min(kBlockN, N - n0);
      block_mm(qp + n0 * K, nb + 1 < end ? qp + (n0 + kBlockN) * K : nullptr, xt.data(), sp, M, K, N, n0, rows / kTile,
               w.data(), cbuf, yp);
    }
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) { m.def("int8_amx_mm(Tensor x, Tensor qweight, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("int8_amx_mm", &int8_amx_mm); }
#endif  // AVX512-BF16 + AMX-BF16
