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
constexpr int64_t kBlockN = 4 * kTile;  // output columns per work item (four A tiles)
constexpr int64_t kChunkM = 2 * kTile;  // activation rows per pass of the 2 x 2 scheme (two B tiles)
constexpr int64_t kBufferElems = 8192;  // bf16 dequantized per slice when one pass covers x (16 KiB: in L1)

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

// C tiles 0-3 -> cbuf: 4 x [16][16] fp32, tile t at t * 256.
void store_c(float* cbuf) {
  _tile_stored(0, cbuf, kTile * 4);
  _tile_stored(1, cbuf + 256, kTile * 4);
  _tile_stored(2, cbuf + 512, kTile * 4);
  _tile_stored(3, cbuf + 768, kTile * 4);
}

// The 2 x 2 scheme's C tiles -> y rows m0.. (scaled, bf16); tile (n-tile a, m-tile b) at 2a + b.
void store_block(float* cbuf, const float* s, int64_t M, int64_t N, int64_t n0, int64_t ntiles, int64_t m0,
                 int64_t mtiles, at::BFloat16* y) {
  store_c(cbuf);
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

// C tile a += A(n-tile a) . B over k in [k0, k0 + len), a < ntiles <= 4, one m-tile (x has <= 16 rows): four
// independent accumulators and one B load per four products.
void accumulate_narrow(const at::BFloat16* w, int64_t lda, const uint32_t* b0, int64_t k0, int64_t len, int64_t ntiles) {
  const int64_t a_stride = lda * 2, t = kTile * lda;
  for (int64_t k = 0; k < len; k += kTileK) {
    _tile_loadd(6, b0 + (k0 + k) / 2 * kTile, kTile * 4);
    _tile_loadd(4, w + k, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (ntiles > 1) {
      _tile_loadd(5, w + t + k, a_stride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (ntiles > 2) {
      _tile_loadd(7, w + 2 * t + k, a_stride);
      _tile_dpbf16ps(2, 7, 6);
    }
    if (ntiles > 3) {
      _tile_loadd(4, w + 3 * t + k, a_stride);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
}

// Dequantize `rows` weight rows in k slices that fill the buffer (kBufferElems: L1-resident) and multiply
// each slice as it is made: x has <= 16 rows (narrow, up to 4 n-tiles) or <= 32 (2 x 2 tiles, <= 2 n-tiles).
void sliced_mm(const int8_t* q, const uint32_t* xt, int64_t M, int64_t K, int64_t rows, at::BFloat16* w) {
  const int64_t ntiles = rows / kTile, slice = std::max<int64_t>(kTileK, kBufferElems / rows / kTileK * kTileK);
  const XChunk xc = x_chunk(xt, M, K, 0);
  zero_c();
  for (int64_t k0 = 0; k0 < K; k0 += slice) {
    const int64_t len = std::min(slice, K - k0);
    for (int64_t r = 0; r < rows; ++r) dequant_row(q + r * K + k0, len, w + r * slice);
    if (M <= kTile) {
      accumulate_narrow(w, slice, xc.b0, k0, len, ntiles);
    } else {
      accumulate(w, slice, xc, k0, len, ntiles);
    }
  }
}

// One block of up to 64 output columns (`ntiles` n-tiles) for all M rows.
void block_mm(const int8_t* q, const uint32_t* xt, const float* s, int64_t M, int64_t K, int64_t N, int64_t n0,
              int64_t ntiles, at::BFloat16* w, float* cbuf, at::BFloat16* y) {
  if (M <= kTile) {  // decode: four n-tiles at once, one m-tile
    sliced_mm(q, xt, M, K, ntiles * kTile, w);
    store_c(cbuf);  // tile a: n-tile a
    for (int64_t a = 0; a < ntiles; ++a) store_tile(cbuf + a * 256, s, 0, M, N, n0 + a * kTile, y);
    return;
  }
  for (int64_t h = 0; h < ntiles; h += 2) {  // halves of 32 columns: 2 n-tiles x 2 m-tiles
    const int64_t nt = std::min<int64_t>(2, ntiles - h), rows = nt * kTile, nh = n0 + h * kTile;
    const int8_t* qh = q + h * kTile * K;
    if (M <= kChunkM) {
      sliced_mm(qh, xt, M, K, rows, w);
      store_block(cbuf, s, M, N, nh, nt, 0, x_chunk(xt, M, K, 0).mtiles, y);
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) dequant_row(qh + r * K, K, w + r * K);  // prefill: dequantize once
    for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
      const XChunk xc = x_chunk(xt, M, K, m0);
      zero_c();
      accumulate(w, K, xc, 0, K, nt);
      store_block(cbuf, s, M, N, nh, nt, m0, xc.mtiles, y);
    }
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
    std::vector<at::BFloat16> w(M <= kChunkM ? kBufferElems : kBlockN / 2 * K);
    alignas(64) float cbuf[4 * 256];
    configure_tiles();
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kBlockN;
      block_mm(qp + n0 * K, xt.data(), sp, M, K, N, n0, std::min(kBlockN, N - n0) / kTile, w.data(), cbuf, yp);
    }
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) { m.def("int8_amx_mm(Tensor x, Tensor qweight, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("int8_amx_mm", &int8_amx_mm); }
#endif  // AVX512-BF16 + AMX-BF16
