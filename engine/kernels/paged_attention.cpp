// Paged attention on CPU that reads K/V where they lie in the block-major cache (no gather copy).
//
// One call covers a set of "runs": consecutive query rows of one request, run r has rows
// [row_start[r], row_start[r] + num_rows[r]) at positions start_pos[r] + i, and sees keys at positions
// <= its own (causal), found through block_tables[r]. A decode is a run of one row; a later prefill
// chunk is a run of n rows. Work item = (run, tile of up to kTileRows query tokens, kv heads): the item's
// rows are the tile's tokens x its kv heads x the query heads that read each (GQA as in HF: q head h reads
// kv head h / group), so each key and value row is read once for all of them. An item takes every kv
// head, so that it reads each cache block's rows for all heads (one contiguous run of memory) while they
// are in cache: 4-6% less time per decode call than one item per head in the offline benchmark's steps,
// where the blocks come from DRAM (the kernel is memory-bound there: at batch 32 and 256 tokens of
// context it reads the cache at ~26 GB/s, about all these two cores can read). With too few items to keep
// every thread busy (a decode of one or two requests) it is one item per kv head instead. Softmax is
// exact two-pass in fp32 over the item's score buffer.
//
// Two inner loops, same structure:
//  * generic (fp32, or bf16 on a CPU without AVX512-BF16, or odd shapes): each key/value row converted
//    to fp32 once, fp32 dot products and accumulation;
//  * bf16 with AVX512-BF16 (head dim a multiple of 32, even block size): q.k with vdpbf16ps straight
//    from the cache's bf16 (no conversion), 16 keys' partial sums reduced together by one transpose-add
//    tree (a per-key horizontal sum was most of the old kernel's time); p.v also with vdpbf16ps on
//    key pairs, p rounded to bf16 first, as Hugging Face's eager attention does
//    (softmax(...).to(dtype) @ v) and SDPA's CPU kernel does. fp32 accumulation.
// The engine sends it decodes only: for prefill chunks gather + SDPA is faster (engine/layers/attention.py).
//
// Reading the cache: a decode step's K/V are far bigger than the CPU's caches (SmolLM2, 30 layers x 8 requests
// x 1,024 tokens: 190 MB), so the kernel reads them from DRAM, in blocks (6 KB there) scattered over the
// cache. The hardware prefetchers stop at each 4 KB page and retrain on every block, so without help the
// kernel read DRAM at ~10 GB/s of the ~40 that two Zen 4 cores stream. Both inner loops therefore prefetch
// into L2 along the item's read order (its K blocks, its V blocks, then the thread's next item's K blocks:
// `ReadStream`), kAheadBlocks ahead of the block being read, a slice of a block per inner iteration so the
// requests spread out instead of filling the miss queue at once. bf16 on Zen 4: 0.62-0.68x a decode step's
// attention time at batch 8-32 and 256-1,024 tokens of context (README, wave 15); fp32 (the generic loop):
// within the noise. Outputs are unchanged.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "simd_math.h"

namespace {

constexpr int64_t kTileRows = 8;  // query tokens per work item: bounds the score buffer
constexpr int64_t kMinItemsPerThread = 4;  // fewer (run, tile) items than this per thread: one item per kv head

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

struct Geometry {
  int64_t hq, hkv, group, dim, block_size;
  int64_t q_s0, q_s1, c_s0, c_s1, c_s2, o_s0, o_s1, table_s0;
};

// One work item's place: kv heads [head0, head0 + nheads) for the tokens t < nt of the tile. Its rows are
// r = (t * nheads + h) * group + j: token t, kv head head0 + h, query head (head0 + h) * group + j; row r
// sees the keys [0, pos0 + t + 1).
struct Item {
  const int64_t* table;  // the run's block table
  int64_t row0, pos0, nt, head0, nheads;
  int64_t rows(const Geometry& g) const { return nt * nheads * g.group; }
  int64_t keys() const { return pos0 + nt; }  // the tile's last token sees [0, pos0 + nt)
  int64_t token(int64_t r, const Geometry& g) const { return r / (nheads * g.group); }
  int64_t head(int64_t r, const Geometry& g) const { return head0 + r / g.group % nheads; }
  int64_t visible(int64_t r, const Geometry& g) const { return pos0 + token(r, g) + 1; }
  int64_t q_offset(int64_t r, const Geometry& g) const {
    return (row0 + token(r, g)) * g.q_s0 + (head(r, g) * g.group + r % g.group) * g.q_s1;
  }
  int64_t o_offset(int64_t r, const Geometry& g) const {
    return (row0 + token(r, g)) * g.o_s0 + (head(r, g) * g.group + r % g.group) * g.o_s1;
  }
  // Key/value row i of block b of kv head h.
  int64_t c_offset(int64_t b, int64_t i, int64_t h, const Geometry& g) const {
    return table[b] * g.c_s0 + i * g.c_s1 + h * g.c_s2;
  }
  Item one_head(int64_t h) const { return {table, row0, pos0, nt, h, 1}; }
};

// Prefetch distance in cache blocks. Measured on Zen 4 at batch 32 x 64 / 256 tokens, 8 x 1,024 and 1 x 512:
// 3-6 within a few percent of each other (4 ahead by 0-7%), 2 and 10-16 slower.
constexpr int64_t kAheadBlocks = 4;

// What one work item reads, in order, as positions: its K blocks [0, n), its V blocks [n, 2n), then the next
// item's K blocks (the same thread's next item, so its first blocks are in L2 when it starts).
template <typename T>
class ReadStream {
 public:
  ReadStream(const T* k, const T* v, const Item& it, const Item* next, const Geometry& g)
      : k_(k), v_(v), it_(it), next_(next), g_(g), nblocks_((it.keys() + g.block_size - 1) / g.block_size),
        lines_per_row_((it.nheads * g.dim * static_cast<int64_t>(sizeof(T)) + 63) / 64),
        lines_(g.block_size * lines_per_row_) {}

  int64_t nblocks() const { return nblocks_; }

  // Prefetches part `part` of `parts` of position p's cache lines into L2. always_inline: GCC judges a
  // function that only prefetches to have no effect and deletes calls to it that are not inlined first.
  __attribute__((always_inline)) void prefetch(int64_t p, int64_t part, int64_t parts) const {
    const T* cache = p < nblocks_ ? k_ : v_;
    const Item* item = &it_;
    int64_t b = p < nblocks_ ? p : p - nblocks_;
    if (p >= 2 * nblocks_) {
      item = next_, cache = k_, b = p - 2 * nblocks_;
      if (item == nullptr || b * g_.block_size >= item->keys() || item->nheads != it_.nheads) return;
    }
    for (int64_t l = part * lines_ / parts; l < (part + 1) * lines_ / parts; ++l) {
      const auto* row = reinterpret_cast<const char*>(cache + item->c_offset(b, l / lines_per_row_, item->head0, g_));
      __builtin_prefetch(row + l % lines_per_row_ * 64, 0, 2);  // read, into L2 (prefetcht1)
    }
  }

 private:
  const T *k_, *v_;
  const Item& it_;
  const Item* next_;
  const Geometry& g_;
  int64_t nblocks_, lines_per_row_, lines_;  // lines: of one block's rows for the item's kv heads
};

// Row r's scores [0, keys) -> probabilities over its visible keys, zero beyond them (so the p.v loops
// may run over whole blocks). fp32, two passes; exp_approx keeps the loops vectorized.
inline void softmax_rows(float* scores, int64_t rows, int64_t keys, const Item& it, const Geometry& g) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * keys;
    const int64_t vis = it.visible(r, g);
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < vis; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < vis; ++i) sum += (s[i] = morphserve::exp_approx(s[i] - mx));
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < vis; ++i) s[i] *= inv;
    std::fill(s + vis, s + keys, 0.f);
  }
}

// ---- generic inner loops (any dtype, any shape), one kv head at a time ----
template <typename T, int64_t DIM>
void attend_generic_head(const T* q, const T* k, const T* v, T* out, const Item& it, const Item* next, float scale,
                         const Geometry& g, std::vector<float>& buf) {
  const ReadStream<T> stream(k, v, it, next, g);
  const int64_t dim = DIM > 0 ? DIM : g.dim, bs = g.block_size, rows = it.rows(g), keys = it.keys();
  const int64_t nblocks = stream.nblocks();
  buf.resize(rows * dim * 2 + dim + rows * keys);
  float* qf = buf.data();          // [rows, dim], pre-scaled
  float* acc = qf + rows * dim;    // [rows, dim]
  float* kv = acc + rows * dim;    // [dim]: one key or value row in fp32
  float* scores = kv + dim;        // [rows, keys]
  for (int64_t r = 0; r < rows; ++r) {
    load_row(q + it.q_offset(r, g), qf + r * dim, dim);
    for (int64_t d = 0; d < dim; ++d) qf[r * dim + d] *= scale;
  }
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t first = b * bs, n = std::min(bs, keys - first);
    for (int64_t i = 0; i < n; ++i) {
      stream.prefetch(b + kAheadBlocks, i, bs);
      load_row(k + it.c_offset(b, i, it.head0, g), kv, dim);
      for (int64_t r = 0; r < rows; ++r) scores[r * keys + first + i] = dot(qf + r * dim, kv, dim);
    }
  }
  softmax_rows(scores, rows, keys, it, g);
  std::fill(acc, acc + rows * dim, 0.f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t first = b * bs, n = std::min(bs, keys - first);
    for (int64_t i = 0; i < n; ++i) {
      stream.prefetch(nblocks + b + kAheadBlocks, i, bs);
      load_row(v + it.c_offset(b, i, it.head0, g), kv, dim);
      for (int64_t r = 0; r < rows; ++r)
        if (first + i < it.visible(r, g)) axpy(scores[r * keys + first + i], kv, acc + r * dim, dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + it.o_offset(r, g);
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[r * dim + d]);
  }
}

template <typename T, int64_t DIM>
void attend_generic(const T* q, const T* k, const T* v, T* out, const Item& it, const Item* next, float scale,
                    const Geometry& g, std::vector<float>& buf) {
  for (int64_t h = it.head0; h < it.head0 + it.nheads; ++h) {
    // One head at a time: the stream runs on into the next head, or the thread's next item's first head.
    Item following{};
    const Item* after = nullptr;
    if (h + 1 < it.head0 + it.nheads) following = it.one_head(h + 1), after = &following;
    else if (next != nullptr) following = next->one_head(next->head0), after = &following;
    attend_generic_head<T, DIM>(q, k, v, out, it.one_head(h), after, scale, g, buf);
  }
}

#if defined(__AVX512BF16__)
// ---- bf16 inner loops with AVX512-BF16 ----

// 16 vectors -> one vector whose lane i is the sum of a[i]'s 16 lanes (a transpose-add tree: 45
// shuffles/adds for 16 sums instead of 16 separate horizontal reductions).
inline __m512 hsum16(const __m512* a) {
  __m512 x[8], y[4], z[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit lane: partial sums of 4 consecutive vectors
    y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 2; ++j)  // 128-bit lanes: [y0.q0+q1, y0.q2+q3, y1.q0+q1, y1.q2+q3]
    z[j] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512bh load_bh(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// acc[r] += p[r] . v for the rows r of the item's kv head head0 + h, over one block's keys [first, first + n)
// (probabilities bf16, ld pkeys; the block's value rows interleaved in pairs, [pair][DIM][2]).
template <int64_t DIM>
void pv_head(int64_t h, int64_t first, int64_t n, const uint16_t* p16, int64_t pkeys, const c10::BFloat16* vpairs,
             float* acc, const Item& it, const Geometry& g) {
  constexpr int64_t ko = DIM / 16;
  for (int64_t t = 0; t < it.nt; ++t) {
    const int64_t vis = std::min(n, it.pos0 + t + 1 - first);  // keys of this block token t sees
    if (vis <= 0) continue;
    for (int64_t r = (t * it.nheads + h) * g.group; r < (t * it.nheads + h + 1) * g.group; ++r) {
      __m512 o[ko];
      float* ar = acc + r * DIM;
      for (int64_t c = 0; c < ko; ++c) o[c] = _mm512_loadu_ps(ar + 16 * c);
      const uint16_t* pr = p16 + r * pkeys + first;  // first is even (even block size): pairs align
      for (int64_t j = 0; j < (vis + 1) / 2; ++j) {
        int32_t pair;
        std::memcpy(&pair, pr + 2 * j, sizeof pair);
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
        const c10::BFloat16* vp = vpairs + j * DIM * 2;
        for (int64_t c = 0; c < ko; ++c) o[c] = _mm512_dpbf16_ps(o[c], pp, load_bh(vp + 32 * c));
      }
      for (int64_t c = 0; c < ko; ++c) _mm512_storeu_ps(ar + 16 * c, o[c]);
    }
  }
}

template <int64_t DIM>
void attend_bf16(const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v, c10::BFloat16* out,
                 const Item& it, const Item* next, float scale, const Geometry& g, std::vector<float>& buf) {
  static_assert(DIM % 32 == 0, "vdpbf16ps takes 32 bf16 per vector");
  constexpr int64_t kq = DIM / 32, ko = DIM / 16;  // q.k vectors per row; fp32 output vectors per row
  const ReadStream<c10::BFloat16> stream(k, v, it, next, g);
  const int64_t bs = g.block_size, rows = it.rows(g), keys = it.keys(), nblocks = stream.nblocks();
  const int64_t pkeys = keys + (keys & 1);  // bf16 probabilities, padded to whole key pairs
  buf.resize(rows * keys + rows * DIM + (rows * pkeys + 1) / 2 + bs * DIM / 2 + 16);
  float* scores = buf.data();                                                   // [rows, keys]
  float* acc = scores + rows * keys;                                            // [rows, DIM]
  auto* p16 = reinterpret_cast<uint16_t*>(acc + rows * DIM);                    // [rows, pkeys] bf16
  auto* vpairs = reinterpret_cast<c10::BFloat16*>(acc + rows * DIM + (rows * pkeys + 1) / 2);  // [bs/2, DIM, 2]
  const __m512 vscale = _mm512_set1_ps(scale);
  // q.k: per row, 16 keys at a time, each key's DIM products summed by vdpbf16ps into one vector.
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t first = b * bs, n = std::min(bs, keys - first);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - i0);
      const c10::BFloat16* kr[16];
      for (int64_t r = 0; r < rows; ++r) {
        if (i0 == 0) stream.prefetch(b + kAheadBlocks, r, rows);
        if (r % g.group == 0)  // the first row of a kv head: that head's key rows
          for (int64_t i = 0; i < m; ++i) kr[i] = k + it.c_offset(b, i0 + i, it.head(r, g), g);
        if (first + i0 >= it.visible(r, g)) continue;  // none of these keys is visible to row r
        const c10::BFloat16* qr = q + it.q_offset(r, g);
        __m512bh qv[kq];
        for (int64_t c = 0; c < kq; ++c) qv[c] = load_bh(qr + 32 * c);
        __m512 part[16];
        for (int64_t i = 0; i < 16; ++i) {
          part[i] = _mm512_setzero_ps();
          if (i < m)
            for (int64_t c = 0; c < kq; ++c) part[i] = _mm512_dpbf16_ps(part[i], qv[c], load_bh(kr[i] + 32 * c));
        }
        _mm512_mask_storeu_ps(scores + r * keys + first + i0, static_cast<__mmask16>((1u << m) - 1),
                              _mm512_mul_ps(hsum16(part), vscale));
      }
    }
  }
  softmax_rows(scores, rows, keys, it, g);  // invisible keys get p = 0
  for (int64_t r = 0; r < rows; ++r) {      // p rounded to bf16, round to nearest even
    uint16_t* dst = p16 + r * pkeys;
    const float* s = scores + r * keys;
    int64_t i = 0;
    for (; i + 16 <= keys; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i)));
    for (; i < keys; ++i) dst[i] = c10::BFloat16(s[i]).x;
    if (pkeys > keys) dst[keys] = 0;
  }
  // p.v: per block and kv head, the value rows interleaved in key pairs once ([pair][dim][2], vdpbf16ps's
  // layout), then per row of that head, per pair, one broadcast of (p_j, p_j+1) and DIM/16 vdpbf16ps into
  // fp32 accumulators.
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int j = 0; j < 16; ++j) {
    lo_idx[2 * j] = j, lo_idx[2 * j + 1] = 32 + j;            // dims j of key a, key b
    hi_idx[2 * j] = 16 + j, hi_idx[2 * j + 1] = 48 + j;       // dims 16 + j
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  std::fill(acc, acc + rows * DIM, 0.f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t first = b * bs, n = std::min(bs, keys - first), pairs = (n + 1) / 2;
    for (int64_t h = 0; h < it.nheads; ++h) {
      stream.prefetch(nblocks + b + kAheadBlocks, h, it.nheads);
      for (int64_t j = 0; j < pairs; ++j) {
        const c10::BFloat16* va = v + it.c_offset(b, 2 * j, it.head0 + h, g);
        const c10::BFloat16* vb = 2 * j + 1 < n ? v + it.c_offset(b, 2 * j + 1, it.head0 + h, g) : nullptr;
        for (int64_t c = 0; c < kq; ++c) {
          const __m512i a = _mm512_loadu_si512(va + 32 * c);
          const __m512i bb = vb ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
          c10::BFloat16* dst = vpairs + (j * DIM + 32 * c) * 2;
          _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo, bb));
          _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, hi, bb));
        }
      }
      pv_head<DIM>(h, b * bs, n, p16, pkeys, vpairs, acc, it, g);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* dst = out + it.o_offset(r, g);
    for (int64_t c = 0; c < ko; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * DIM + 16 * c)));
  }
}
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                  const at::Tensor& row_start, const at::Tensor& num_rows, const at::Tensor& start_pos) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "paged_attention: q [T, Hq, D], caches [N, bs, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "paged_attention: q and the caches must share a dtype");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides(), "paged_attention: K and V caches differ in layout");
  TORCH_CHECK(q.stride(2) == 1, "paged_attention: q's head dimension must be contiguous");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == k.size(3) && k.stride(1) == k.size(2) * k.size(3),
              "paged_attention: each cache block must be one contiguous [block_size, Hkv, D] run");
  TORCH_CHECK(q.size(2) == k.size(3) && q.size(1) % k.size(2) == 0, "paged_attention: head shapes do not match");
  for (const auto* t : {&tables, &row_start, &num_rows, &start_pos})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention: index tensors must be contiguous int64 on CPU");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == row_start.size(0) && row_start.sizes() == num_rows.sizes() &&
              num_rows.sizes() == start_pos.sizes(), "paged_attention: one table row and one run per request");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& row_start, const at::Tensor& num_rows,
                           const at::Tensor& start_pos, double scale) {
  check_inputs(q, k_cache, v_cache, block_tables, row_start, num_rows, start_pos);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_attention: float32 or bfloat16 only, got ", q.scalar_type());
  auto out = at::zeros_like(q, at::MemoryFormat::Contiguous);
  const Geometry g{q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), q.size(2), k_cache.size(1),
                   q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   out.stride(0), out.stride(1), block_tables.stride(0)};
  const int64_t* rs = row_start.data_ptr<int64_t>();
  const int64_t* nr = num_rows.data_ptr<int64_t>();
  const int64_t* sp = start_pos.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t nblk_max = block_tables.size(1);
  // Work items: (run, kv head, tile). Validate every block id once, up front.
  std::vector<Item> items;
  for (int64_t r = 0; r < row_start.size(0); ++r) {
    TORCH_CHECK(rs[r] >= 0 && nr[r] >= 0 && rs[r] + nr[r] <= q.size(0) && sp[r] >= 0, "paged_attention: run out of range");
    TORCH_CHECK((sp[r] + nr[r] + g.block_size - 1) / g.block_size <= nblk_max, "paged_attention: block table too short");
    const int64_t* table = tables + r * g.table_s0;
    for (int64_t b = 0; b < (sp[r] + nr[r] + g.block_size - 1) / g.block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < k_cache.size(0), "paged_attention: block id ", table[b], " out of range");
    for (int64_t t = 0; t < nr[r]; t += kTileRows)
      items.push_back({table, rs[r] + t, sp[r] + t, std::min(kTileRows, nr[r] - t), 0, g.hkv});
  }
  if (static_cast<int64_t>(items.size()) < kMinItemsPerThread * at::get_num_threads()) {
    std::vector<Item> split;  // too few to share out: one item per kv head
    for (const Item& it : items)
      for (int64_t h = 0; h < g.hkv; ++h) split.push_back(it.one_head(h));
    items.swap(split);
  }
  const float fscale = static_cast<float>(scale);
  auto run = [&](auto attend) {  // attend(item, the thread's next item or nullptr, buffer)
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t w = begin; w < end; ++w) attend(items[w], w + 1 < end ? &items[w + 1] : nullptr, buf);
    });
  };
  auto generic = [&]<typename T, int64_t DIM>(const T* qp, const T* kp, const T* vp, T* op) {
    run([&](const Item& it, const Item* next, std::vector<float>& buf) { attend_generic<T, DIM>(qp, kp, vp, op, it, next, fscale, g, buf); });
  };
  if (q.scalar_type() == at::kFloat) {
    const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
    float* op = out.data_ptr<float>();
    if (g.dim == 64) generic.template operator()<float, 64>(qp, kp, vp, op);
    else generic.template operator()<float, 0>(qp, kp, vp, op);
    return out;
  }
  using B = c10::BFloat16;
  const B *qp = q.data_ptr<B>(), *kp = k_cache.data_ptr<B>(), *vp = v_cache.data_ptr<B>();
  B* op = out.data_ptr<B>();
#if defined(__AVX512BF16__)
  if (kHaveBf16Dot && g.block_size % 2 == 0 && (g.dim == 32 || g.dim == 64 || g.dim == 128)) {
    auto fast = [&]<int64_t DIM>() {
      run([&](const Item& it, const Item* next, std::vector<float>& buf) { attend_bf16<DIM>(qp, kp, vp, op, it, next, fscale, g, buf); });
    };
    if (g.dim == 32) fast.template operator()<32>();
    else if (g.dim == 64) fast.template operator()<64>();
    else fast.template operator()<128>();
    return out;
  }
#endif
  if (g.dim == 64) generic.template operator()<B, 64>(qp, kp, vp, op);
  else generic.template operator()<B, 0>(qp, kp, vp, op);
  return out;
}

}  // namespace

TORCH_LIBRARY(morphserve, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor row_start, "
        "Tensor num_rows, Tensor start_pos, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("paged_attention", &paged_attention); }
