// Paged attention on CPU that reads K/V where they lie in the block-major cache (no gather copy).
//
// One call covers a set of "runs": consecutive query rows of one request, run r has rows
// [row_start[r], row_start[r] + num_rows[r]) at positions start_pos[r] + i, and sees keys at positions
// <= its own (causal), found through block_tables[r]. A decode is a run of one row; a later prefill
// chunk is a run of n rows. Work item = (run, tile of up to kTileRows query tokens); each item
// converts one cache block of K (then of V) to fp32 once and uses it for all the item's query rows
// (the tile's tokens x every query head, GQA as in HF: q head h reads kv head h / group). Softmax is
// exact two-pass in fp32 (the scores of the item stay in a buffer). Accumulation is fp32 throughout.
// The engine sends it decodes only: for prefill chunks gather + SDPA is faster (engine/layers/attention.py).
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

namespace {

constexpr int64_t kTileRows = 8;  // query tokens per work item: bounds the score buffer

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

// One work item: a tile of nt query tokens of one run, every query head. Row r = t * hq + head (query
// head `head` reads kv head head / group). A cache block is [bs, hkv, dim] contiguous, so each block
// of K (then V) is converted to fp32 in one pass (software prefetch of the next block measured no gain).
// DIM > 0: the head dimension known at compile time (fully vectorized loops); 0: any, at run time.
template <typename T, int64_t DIM>
void attend_item(const T* q, const T* k, const T* v, T* out, const int64_t* table, int64_t row0,
                 int64_t pos0, int64_t nt, float scale, const Geometry& g, std::vector<float>& buf) {
  const int64_t dim = DIM > 0 ? DIM : g.dim, bs = g.block_size, hkv = g.hkv, hq = g.hq;
  const int64_t rows = nt * hq, keys = pos0 + nt;  // the tile's last token sees [0, pos0 + nt)
  const int64_t nblocks = (keys + bs - 1) / bs, block_elems = bs * hkv * dim;
  buf.resize(rows * dim * 2 + block_elems + rows * keys);
  float* qf = buf.data();            // [rows, dim], pre-scaled
  float* acc = qf + rows * dim;      // [rows, dim]
  float* blk = acc + rows * dim;     // [bs, hkv, dim]: one block of K or V in fp32
  float* scores = blk + block_elems; // [rows, keys]
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t h = 0; h < hq; ++h) {
      float* dst = qf + (t * hq + h) * dim;
      load_row(q + (row0 + t) * g.q_s0 + h * g.q_s1, dst, dim);
      for (int64_t d = 0; d < dim; ++d) dst[d] *= scale;
    }
  auto visible = [&](int64_t r) { return pos0 + r / hq + 1; };
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t first = b * bs, n = std::min(bs, keys - first);
    load_row(k + table[b] * g.c_s0, blk, n * hkv * dim);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = qf + r * dim;
      const float* kh = blk + (r % hq) / g.group * dim;
      for (int64_t i = 0; i < n; ++i) scores[r * keys + first + i] = dot(qr, kh + i * hkv * dim, dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // softmax over this row's visible keys, fp32
    float* s = scores + r * keys;
    const int64_t vis = visible(r);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < vis; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < vis; ++i) sum += (s[i] = std::exp(s[i] - mx));
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < vis; ++i) s[i] *= inv;
  }
  std::fill(acc, acc + rows * dim, 0.f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t first = b * bs, n = std::min(bs, keys - first);
    load_row(v + table[b] * g.c_s0, blk, n * hkv * dim);
    for (int64_t r = 0; r < rows; ++r) {
      const float* vh = blk + (r % hq) / g.group * dim;
      const float* p = scores + r * keys + first;
      float* a = acc + r * dim;
      const int64_t m = std::min(n, visible(r) - first);
      for (int64_t i = 0; i < m; ++i) axpy(p[i], vh + i * hkv * dim, a, dim);
    }
  }
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t h = 0; h < hq; ++h) {
      const float* src = acc + (t * hq + h) * dim;
      T* dst = out + (row0 + t) * g.o_s0 + h * g.o_s1;
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(src[d]);
    }
}

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
  auto out = at::zeros_like(q, at::MemoryFormat::Contiguous);
  const Geometry g{q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), q.size(2), k_cache.size(1),
                   q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   out.stride(0), out.stride(1), block_tables.stride(0)};
  const int64_t* rs = row_start.data_ptr<int64_t>();
  const int64_t* nr = num_rows.data_ptr<int64_t>();
  const int64_t* sp = start_pos.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t nblk_max = block_tables.size(1);
  // Work items: (run, tile); each covers every kv head. Validate once, up front.
  std::vector<std::array<int64_t, 2>> tiles;
  for (int64_t r = 0; r < row_start.size(0); ++r) {
    TORCH_CHECK(rs[r] >= 0 && nr[r] >= 0 && rs[r] + nr[r] <= q.size(0) && sp[r] >= 0, "paged_attention: run out of range");
    TORCH_CHECK((sp[r] + nr[r] + g.block_size - 1) / g.block_size <= nblk_max, "paged_attention: block table too short");
    for (int64_t b = 0; b < (sp[r] + nr[r] + g.block_size - 1) / g.block_size; ++b) {
      const int64_t id = tables[r * g.table_s0 + b];
      TORCH_CHECK(id >= 0 && id < k_cache.size(0), "paged_attention: block id ", id, " out of range");
    }
    for (int64_t t = 0; t < nr[r]; t += kTileRows) tiles.push_back({r, t});
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_attention: float32 or bfloat16 only, got ", q.scalar_type());
  const int64_t items = static_cast<int64_t>(tiles.size());
  auto run = [&]<int64_t DIM>(auto* qp, auto* kp, auto* vp, auto* op) {
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t w = begin; w < end; ++w) {
        const auto& [r, t] = tiles[w];
        attend_item<std::remove_pointer_t<decltype(op)>, DIM>(qp, kp, vp, op, tables + r * g.table_s0, rs[r] + t,
            sp[r] + t, std::min(kTileRows, nr[r] - t), static_cast<float>(scale), g, buf);
      }
    });
  };
  auto by_dim = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    if (g.dim == 64) run.template operator()<64>(qp, kp, vp, op);
    else if (g.dim == 128) run.template operator()<128>(qp, kp, vp, op);
    else run.template operator()<0>(qp, kp, vp, op);
  };
  if (q.scalar_type() == at::kFloat)
    by_dim(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>());
  else
    by_dim(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
           out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY(morphserve, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor row_start, "
        "Tensor num_rows, Tensor start_pos, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("paged_attention", &paged_attention); }
