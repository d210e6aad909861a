// INT8 (weight-only, per-output-row scale) x bf16 linear on a CPU with AVX512-BF16 and no AMX-INT8 (e.g.
// AMD Zen 4), reading the host store's INT8 record as it is: qweight int8 [N, K] row-major, scales fp32 [N];
// y[m, n] = s[n] * sum_k x[m, k] * q[n, k].
//
// Why: there INT8 layers ran torch's _weight_int8pack_mm, which took 3.0-3.4x the engine's bf16 linears'
// time at 16-512 rows (SmolLM2's four shapes, 2 threads, Zen 4): a morphed replica slowed by the very
// layers it quantized to take a burst. Here the weights go through the bf16 linear's own two routes
// (bf16_vnni.h): each work item turns one block of 32 weight rows into bf16 in the vnni32 layout in an
// L2-sized buffer (int8 -> bf16 is exact; a 16 x 16 transpose puts 16 rows' (k even, k odd) pairs side by
// side) and multiplies it by register tiles below kVnniGemmRows rows, by brgemm from there; the scale
// multiplies each fp32 sum before the output's one rounding. So, like the bf16 op, every row's output is
// the same at any row count below kVnniGemmRows (batch-invariant) and may differ from there. Measured the
// same way: 1.52x the bf16 time at 16 rows, 1.20x at 64, 1.01-1.05x at 256-512. A 16-lane scatter per row
// and 32 weights, instead of the transpose, took 1.07-1.16x at 256-512 rows.
// Filling the buffer costs as much as a dozen rows' products, so below 12 rows (int8.resolve_int8_min_rows)
// a second op, int8_avx512_rows_mm, converts the codes in registers and dots them with each row of x:
// 0.63 / 0.79 / 1.23x the bf16 time at 1 / 4 / 8 rows, where torch's kernel took 1.59 / 1.92 / 2.83x.
// Compiled only where the compiler targets AVX512-BF16 (-march=native).
#if defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "bf16_vnni.h"

namespace {

using BF = at::BFloat16;
constexpr int64_t kB = morphserve::kVnniBlockN;
constexpr int64_t kChunkRows = 96;  // rows per work item below kVnniGemmRows (x chunk stays in L2), as the bf16 op

// r[i] = row i's 16 lanes -> r[p] = lane p of the 16 rows (a 16 x 16 transpose of 32-bit elements): pairs
// within 128-bit lanes, then 64-bit halves, then 128-bit lanes across registers; 64 shuffles in all.
void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);      // lane L: (r_i, r_i+1) at 4L, 4L + 1
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  // at 4L + 2, 4L + 3
  }
  for (int i = 0; i < 16; i += 4) {  // b[i + c], lane L: element 4L + c of rows i .. i + 3
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of the four row groups: element 4L + c of all 16 rows
    const __m512i even0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88);  // lanes 0, 2 of each
    const __m512i odd0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);   // lanes 1, 3
    const __m512i even1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i odd1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(even0, even1, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(even0, even1, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0xDD);
  }
}

// Weight rows [32 b, 32 b + 32) -> bf16 q (exact) in the vnni32 layout ([K/2][32][2]) at `out`, 16 rows x
// 32 k at a time: each row's 32 weights become 16 (k even, k odd) pairs in order, and a transpose turns the
// 16 rows' pairs into 16 pair-rows of 16 columns, each one 64-byte store.
void dequant_rows32(const int8_t* q, int64_t K, int64_t b, BF* out) {
  auto* pairs = reinterpret_cast<int32_t*>(out);
  for (int64_t j0 = 0; j0 < kB; j0 += 16)
    for (int64_t k = 0; k < K; k += 32) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int8_t* row = q + (b * kB + j0 + i) * K + k;
        const auto load = [&](int64_t at) {
          return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + at))));
        };
        r[i] = (__m512i)_mm512_cvtne2ps_pbh(load(16), load(0));  // bf16 of k .. k + 31, in order
      }
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(pairs + (k / 2 + p) * kB + j0, r[p]);
    }
}

// Few rows (decode steps below the tile op's threshold): y[m][n] = s[n] * x[m] . q[n] with no conversion
// buffer: four weight rows at a time, each row's codes converted 32 at a time in registers and dotted with
// the R rows of x as 16 (k even, k odd) pairs, one 16-lane fp32 partial sum per output, reduced at the end.
template <int R>
void dot_rows(const BF* x, int64_t K, const int8_t* q, const float* s, int64_t n0, int64_t n1, BF* y, int64_t N) {
  constexpr int C = 4;
  for (int64_t n = n0; n < n1; n += C) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh xv[R];
      for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int c = 0; c < C; ++c) {
        const int8_t* row = q + (n + c) * K + k;
        const auto load = [&](int64_t at) {
          return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + at))));
        };
        const __m512bh w = _mm512_cvtne2ps_pbh(load(16), load(0));
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], w);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[r * N + n + c] = BF(_mm512_reduce_add_ps(acc[r][c]) * s[n + c]);
  }
}

template <int... Rs>
void dot_rows_of(int64_t rows, const BF* x, int64_t K, const int8_t* q, const float* s, int64_t n0, int64_t n1, BF* y,
                 int64_t N, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? (dot_rows<Rs + 1>(x, K, q, s, n0, n1, y, N), 0) : 0), ...);
}

// make_filler of bf16_vnni.h's vnni_gemm_filled / vnni_fill_all: 32-row blocks of codes as bf16.
auto codes_filler(const int8_t* q, int64_t K) {
  return [=] { return [=](int64_t b, BF* out) { dequant_rows32(q, K, b, out); }; };
}

void check_codes(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.device().is_cpu(),
              "qweight must be contiguous int8 [N, K] on the CPU");
  TORCH_CHECK(q.size(0) % kB == 0 && q.size(1) % 32 == 0, "unsupported shape: N and K must be multiples of 32, got ",
              q.size(0), " x ", q.size(1));
}

// One call's operands, checked (both ops take the same): x contiguous, y allocated.
struct Call {
  int64_t M, K, N;
  at::Tensor x, y;
  const int8_t* qp;
  const float* sp;
  const BF* xp() const { return x.data_ptr<BF>(); }
  BF* yp() const { return y.data_ptr<BF>(); }
};

Call checked_call(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be bf16 [M, K] on the CPU");
  check_codes(q);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K, "the weight has ", q.size(1), " in_features, x ", K, " columns");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == N,
              "scales must be contiguous fp32 [N]");
  return {M, K, N, x.contiguous(), at::empty({M, N}, x.options()), q.data_ptr<int8_t>(), scales.data_ptr<float>()};
}

at::Tensor int8_avx512_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  const Call c = checked_call(x, q, scales);
  const int64_t M = c.M, K = c.K, N = c.N;
  if (M == 0) return c.y;
  const BF* xp = c.xp();
  const int8_t* qp = c.qp;
  const float* sp = c.sp;
  BF* yp = c.yp();
  if (M >= morphserve::kVnniGemmRows) {
    morphserve::vnni_gemm_filled(xp, M, K, N, codes_filler(qp, K), yp, sp);
    return c.y;
  }
  // Work items (chunk of up to kChunkRows rows, block): a decode step's items are its blocks.
  const int64_t blocks = N / kB, chunks = (M + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    const std::unique_ptr<BF[]> w(new BF[K * kB]);  // written in full by dequant_rows32
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = (i / blocks) * kChunkRows, b = i % blocks, m1 = std::min(M, m0 + kChunkRows);
      dequant_rows32(qp, K, b, w.get());
      morphserve::vnni_tiles(xp, m0, m1, K, w.get(), nullptr, sp + b * kB, yp + b * kB, N);
    }
  });
  return c.y;
}

// The few-rows op: rows of x in groups of up to kDotRows, the weight's rows split over the threads in
// blocks of 32. Row-invariant too (a row's sums do not depend on its group), but summed in another order
// than int8_avx512_mm's tiles.
constexpr int kDotRows = 4;  // 16 accumulators + 4 rows of x + 1 converted weight vector

at::Tensor int8_avx512_rows_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  const Call c = checked_call(x, q, scales);
  if (c.M == 0) return c.y;
  at::parallel_for(0, c.N / kB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < c.M; m += kDotRows)
      dot_rows_of(std::min<int64_t>(kDotRows, c.M - m), c.xp() + m * c.K, c.K, c.qp, c.sp, begin * kB, end * kB,
                  c.yp() + m * c.N, c.N, std::make_integer_sequence<int, kDotRows>{});
  });
  return c.y;
}

// The weight's codes as bf16 in the vnni32 layout, as int8_avx512_mm multiplies by them (the scales apart);
// for tests and tools.
at::Tensor int8_avx512_codes(const at::Tensor& q) {
  check_codes(q);
  const int64_t N = q.size(0), K = q.size(1);
  auto out = at::empty({N / kB, K / 2, kB, 2}, q.options().dtype(at::kBFloat16));
  morphserve::vnni_fill_all(K, N, codes_filler(q.data_ptr<int8_t>(), K), out.data_ptr<BF>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int8_avx512_mm(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int8_avx512_rows_mm(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int8_avx512_codes(Tensor qweight) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("int8_avx512_mm", &int8_avx512_mm);
  m.impl("int8_avx512_rows_mm", &int8_avx512_rows_mm);
  m.impl("int8_avx512_codes", &int8_avx512_codes);
}
#endif  // AVX512-BF16
