// INT4 x bf16 linear with AVX512-BF16 (no AMX), reading torch's CPU int4pack bytes (AVX512 layout:
// 64-column blocks; the bytes the host store keeps and Int4Linear holds, so swaps and the ledger are
// unchanged). The same arithmetic as int4_amx.cpp, with vdpbf16ps register tiles instead of AMX tiles:
//     y[m][n] = sum_g  s[g][n] * sum_{k in g} x[m][k] * (128 + code[k][n])  +  (b[g][n] - 128 s[g][n]) * X_g[m]
// (w = code * s + b, b = zp - 8 s: torch's int4pack convention; X_g[m] = sum_{k in g} x[m][k]).
//
// Why: on a CPU with AVX512-BF16 and no AMX (AMD Zen 4) torch's _weight_int4pack_mm_for_cpu made a
// decode step at 16 rows 1.22x (15 INT4 layers) and 1.46x (30) slower than the packed bf16 linears
// (bf16_avx512.cpp): it dequantizes each weight with float math on every call. Here each row tile turns
// a pair of rows' codes into bf16 (128 + code) in registers (int4_codes.h: two byte permutes, four logic
// ops) right before its dot products: R rows x 64 columns of fp32 partial sums per group, one broadcast
// of an (x[k], x[k+1]) pair per row and four vdpbf16ps per pair of k. Products are exact (bf16 x small
// integer) and each group's scale and offset are applied in fp32. A row's output depends only on its
// own row (batch-invariant below kVnniGemmRows rows: see below), bit-identical to the earlier versions'.
// History (SmolLM2's four shapes, 30 copies, 2 threads, Zen 4, interleaved against the engine's bf16
// linears): decoding a whole 64-column block into an L2 buffer first, reading the codes only then:
// 0.6-0.8x the bf16 time at 1 row, 1.3-1.35x at 16; group by group into an L1 buffer with the codes two
// groups ahead prefetched inside the dot-product loop: 0.45-0.55x and ~1.1x; decoding in registers
// (no buffer: its 512-bit stores and reloads were most of what decoding cost, and a 6-row tile has
// enough vdpbf16ps per pair of rows to hide the permutes): 0.45x at 1 row, 0.96-1.08x at 16 over several
// runs, and 0.40-0.45x torch's int4pack kernel at every row count, so on this CPU the op runs from one
// row up (int4_kernel.resolve_int4_min_rows). What is left at 16 rows: the per-group scaling (two fp32
// FMAs per accumulator per group, ~6% of the dot products at a group of 64) and the decoding's share
// of the vector ports, on top of the same dot products as the bf16 op, which runs near their peak there.
// Decoding the high nibbles with one VBMI2 double shift (0x00YX -> 0x400Y, (128 + Y) / 64, its scale x 64)
// instead of a shift and an OR measured no faster (16 rows, 4 interleaved runs: 1.02-1.11x the bf16 op
// against 0.98-1.09x), so the decoder keeps its eight logic ops.
// From kVnniGemmRows rows (prefill chunks; bf16_vnni.h) each thread dequantizes one 32-column block at a
// time into bf16 in the vnni32 layout and runs the bf16 op's brgemm on it (gemm_dequantized): decoding is
// paid once for hundreds of rows, and brgemm on bf16 weights skips the tiles' per-group fp32 scaling.
// SmolLM2's four shapes summed, 256-2,048 rows, 1 and 2 threads, Zen 4, interleaved: the tiles took
// 1.13-1.17x the bf16 linears' time, this route 0.99-1.04x; a 512-token prefill chunk with 15 / 30 INT4
// layers went from 1.055x / 1.113x the bf16 chunk's time to 1.007x / 0.972x (1 thread). That route rounds
// each weight to bf16 (as AWQ's GEMM kernels and vLLM's AWQ path from 256 tokens do), so, as with the bf16
// op, a row's bits are the same at every row count below kVnniGemmRows and may differ from there.
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

#include "bf16_vnni.h"
#include "int4_codes.h"

namespace {

using BF = at::BFloat16;
using morphserve::kInt4BlockN;
constexpr int64_t kTileRows = 6;  // 6 rows x 4 column vectors = 24 accumulators + 4 decoded weights + 1 broadcast
constexpr int64_t kPrefetchGroups = 2;  // 1 took 1.1x the time of 2 at 1 row, the same at 8-32
constexpr int64_t kChunkRows = 96;  // rows per chunk of work items: their x stays in L2 while every block runs

// acc[R][64] += s_g * (x rows . codes of group g) + offset_g * X_g for rows [0, R) of x (ld K, starting at
// the group's first column). codes: the group's G rows of the block's int4pack bytes ([G][32]); scale /
// offset: the group's [64]; xsum: X_g of row 0 (the rows' sums are `groups` apart). `ahead` (or null):
// G * 32 bytes of codes to prefetch, one line per pair of k, so their read overlaps these dot products.
template <int R>
void tile(const BF* x, int64_t K, const uint8_t* codes, int64_t G, const float* scale, const float* offset,
          const float* xsum, int64_t groups, float* acc, const uint8_t* ahead, const morphserve::Int4PairDecoder& dec) {
  const auto* xp = reinterpret_cast<const int32_t*>(x);  // one int32 = an (x[2p], x[2p + 1]) pair
  __m512 part[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) part[r][q] = _mm512_setzero_ps();
  for (int64_t p = 0; p < G / 2; ++p) {
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + p * 64), _MM_HINT_T0);
    __m512bh w[4];
    dec.decode(codes + p * 64, w);
    for (int r = 0; r < R; ++r) {
      const auto a = (__m512bh)_mm512_set1_epi32(xp[r * (K / 2) + p]);
      for (int q = 0; q < 4; ++q) part[r][q] = _mm512_dpbf16_ps(part[r][q], a, w[q]);
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
void tile_rows(int64_t rows, const BF* x, int64_t K, const uint8_t* codes, int64_t G, const float* scale,
               const float* offset, const float* xsum, int64_t groups, float* acc, const uint8_t* ahead,
               const morphserve::Int4PairDecoder& dec, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? (tile<Rs + 1>(x, K, codes, G, scale, offset, xsum, groups, acc, ahead, dec), 0) : 0), ...);
}

// 64-byte aligned scratch, freed on scope exit (a std::vector of BFloat16 would zero it element by element).
struct Scratch {
  explicit Scratch(int64_t bytes) : p(std::aligned_alloc(64, (bytes + 63) / 64 * 64)) { TORCH_CHECK(p, "out of memory"); }
  Scratch(const Scratch&) = delete;  // one owner of the allocation
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(p); }
  template <typename T> T* as() const { return static_cast<T*>(p); }
  void* p;
};

// A thread's [groups][64] scales and offsets of one 64-column block (int4_block_scales), kept while its
// consecutive work items read the same block.
struct BlockScales {
  BlockScales(const BF* sz, int64_t N, int64_t groups)
      : sz(sz), N(N), groups(groups), buf(2 * groups * kInt4BlockN * sizeof(float)) {}
  void load(int64_t nb) {
    if (nb != of) morphserve::int4_block_scales(sz, N, nb, groups, scale(), offset()), of = nb;
  }
  float* scale() const { return buf.as<float>(); }
  float* offset() const { return scale() + groups * kInt4BlockN; }
  const BF* sz;
  int64_t N, groups;
  Scratch buf;
  int64_t of = -1;  // the block held
};

// 32-column block b of the weight (columns 32 b .., half b % 2 of the int4pack layout's 64-column block
// b / 2) -> bf16 w = code * s + (zp - 8 s) in the vnni32 layout ([K/2][32][2], engine/layers/packed.py) at
// `out`: each pair of rows' codes decoded as for the tiles, (128 + code) * s + offset in fp32 (one
// rounding), then rounded to bf16 once. `scales` holds block b / 2's.
void dequant_block32(const uint8_t* packed, int64_t K, int64_t G, int64_t b, const BlockScales& scales, BF* out,
                     const morphserve::Int4PairDecoder& dec) {
  const float *scale = scales.scale(), *offset = scales.offset();
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  // cvtne2ps_pbh gives [row k x 16, row k + 1 x 16]; word 2 j <- j, word 2 j + 1 <- 16 + j: (row k, row k + 1) pairs
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const uint8_t* block = packed + (b / 2) * K * 32;
  const int q0 = 2 * (b % 2);  // the decoder's column vectors q0, q0 + 1 hold this half
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512bh w[4];
    dec.decode(block + p * 64, w);
    const int64_t g = 2 * p / G;
    for (int h = 0; h < 2; ++h) {
      const int q = q0 + h;
      const __m512 s = _mm512_load_ps(scale + g * kInt4BlockN + 16 * q);
      const __m512 o = _mm512_load_ps(offset + g * kInt4BlockN + 16 * q);
      const __m512 even = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32((__m512i)w[q], 16)), s, o);
      const __m512 odd = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512((__m512i)w[q], high_half)), s, o);
      _mm512_storeu_si512(out + p * 2 * morphserve::kVnniBlockN + h * morphserve::kVnniBlockN,
                          _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(odd, even)));
    }
  }
}

// make_filler of bf16_vnni.h's vnni_gemm_filled / vnni_fill_all: each thread's dequantizer of 32-column
// blocks (with its own copy of the current 64-column block's scales).
auto block_filler(const uint8_t* packed, const BF* sz, int64_t K, int64_t N, int64_t G) {
  return [=] {
    return [=, scales = BlockScales(sz, N, K / G), dec = morphserve::Int4PairDecoder()](int64_t b, BF* out) mutable {
      scales.load(b / 2);
      dequant_block32(packed, K, G, b, scales, out, dec);
    };
  };
}

// From kVnniGemmRows rows: the weight dequantized one 32-column block at a time (bf16_vnni.h).
void gemm_dequantized(const BF* x, int64_t M, int64_t K, int64_t N, const uint8_t* packed, int64_t G, const BF* sz, BF* y) {
  morphserve::vnni_gemm_filled(x, M, K, N, block_filler(packed, sz, K, N, G), y);
}

void check_weight(const at::Tensor& packed, int64_t group_size, const at::Tensor& sz, int64_t K) {
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(2) == 2 && sz.is_contiguous(),
              "scales_and_zeros must be contiguous bf16 [K/G, N, 2]");
  const int64_t N = sz.size(1);
  TORCH_CHECK(group_size > 0 && sz.size(0) * group_size == K, "the weight has ", sz.size(0) * group_size,
              " in_features (scales_and_zeros' groups x group_size), not ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == N * K / 2 && packed.is_contiguous(),
              "packed must be int4pack uint8 [N, K/2]");
  TORCH_CHECK(N % kInt4BlockN == 0 && group_size % 16 == 0,
              "unsupported shape: N must be a multiple of 64, the group size a multiple of 16");
}

// The weight as bf16 in the vnni32 layout, as gemm_dequantized multiplies by it; for tests and tools.
// K: the weight's in_features.
at::Tensor int4_avx512_dequant(const at::Tensor& packed, int64_t group_size, const at::Tensor& sz, int64_t K) {
  check_weight(packed, group_size, sz, K);
  const int64_t N = sz.size(1);
  auto out = at::empty({N / morphserve::kVnniBlockN, K / 2, morphserve::kVnniBlockN, 2}, sz.options());
  morphserve::vnni_fill_all(K, N, block_filler(packed.data_ptr<uint8_t>(), sz.data_ptr<BF>(), K, N, group_size),
                            out.data_ptr<BF>());
  return out;
}

at::Tensor int4_avx512_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& sz) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be bf16 [M, K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  check_weight(packed, group_size, sz, K);
  const int64_t N = sz.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t G = group_size, groups = K / G;
  const auto xc = x.contiguous();
  const BF* xp = xc.data_ptr<BF>();
  if (M >= morphserve::kVnniGemmRows) {
    gemm_dequantized(xp, M, K, N, packed.data_ptr<uint8_t>(), G, sz.data_ptr<BF>(), y.data_ptr<BF>());
    return y;
  }
  std::vector<float> xsum(M * groups);  // X_g[m]
  morphserve::int4_group_sums(xp, M, K, G, xsum.data());
  const auto* pp = packed.data_ptr<uint8_t>();
  const auto* szp = sz.data_ptr<BF>();
  auto* yp = y.data_ptr<BF>();
  // Work items (chunk of up to kChunkRows rows, block, row tile), in that order: a decode step's items are
  // its (block, tile) pairs, so the threads split them evenly even when the blocks do not divide (9 blocks
  // of a 576-column weight: 5 and 4 per thread; with 16 rows, 27 items: 14 and 13), and consecutive items
  // share a block's codes and scales. Prefill chunks keep their rows of x in L2 across the blocks.
  const int64_t blocks = N / kInt4BlockN, tiles = (M + kTileRows - 1) / kTileRows;
  constexpr int64_t kChunkTiles = kChunkRows / kTileRows;
  const int64_t full_chunks = tiles / kChunkTiles, last_tiles = tiles % kChunkTiles;
  at::parallel_for(0, (full_chunks * kChunkTiles + last_tiles) * blocks, 1, [&](int64_t begin, int64_t end) {
    BlockScales scales(szp, N, groups);
    const morphserve::Int4PairDecoder dec;
    alignas(64) float acc[kTileRows * kInt4BlockN];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i / (kChunkTiles * blocks), in_chunk = i % (kChunkTiles * blocks);
      const int64_t chunk_tiles = chunk < full_chunks ? kChunkTiles : last_tiles;
      // A block's tiles run last tile first: a short last tile (16 rows = 6 + 6 + 4) then falls at the
      // front of a block, so when the threads' halves split a block (9 blocks: 14 and 13 items) the
      // halves hold 74 and 70 of the 144 block-rows instead of 76 and 68.
      const int64_t tile = (in_chunk + chunk_tiles - 1) % chunk_tiles;
      const int64_t nb = in_chunk / chunk_tiles, m0 = (chunk * kChunkTiles + tile) * kTileRows;
      const int64_t rows = std::min(kTileRows, M - m0);
      scales.load(nb);
      std::fill(acc, acc + rows * kInt4BlockN, 0.f);
      const uint8_t* block = pp + nb * K * 32;
      for (int64_t g = 0; g < groups; ++g) {
        // Codes kPrefetchGroups groups on (maybe in the next block; near the end, the weight's last group),
        // read while this tile computes: later groups and the block's other tiles then find them in cache.
        const uint8_t* ahead = pp + std::min(nb * K * 32 + (g + kPrefetchGroups) * G * 32, N * K / 2 - G * 32);
        tile_rows(rows, xp + m0 * K + g * G, K, block + g * G * 32, G, scales.scale() + g * kInt4BlockN,
                  scales.offset() + g * kInt4BlockN, xsum.data() + m0 * groups + g, groups, acc, ahead, dec,
                  std::make_integer_sequence<int, kTileRows>{});
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
  m.def("int4_avx512_dequant(Tensor packed, int group_size, Tensor scales_and_zeros, int in_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("int4_avx512_mm", &int4_avx512_mm);
  m.impl("int4_avx512_dequant", &int4_avx512_dequant);
}
#endif  // AVX512-BF16 + AVX512-VBMI
