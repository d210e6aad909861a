// Writing a step's new K/V rows into their slots of the paged cache: for every token t,
//     k_cache[blocks[t], offsets[t]] = k[t]   and the same for v,
// one row of num_kv_heads x head_dim values each (contiguous in both). torch's index_put_ does this
// as two calls per layer with the full advanced-indexing machinery (60 calls, about 1 ms of a batch-32
// decode step here); this is a bounds check and a memcpy per row.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace {

void check_rows(const at::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.dim() == dims && t.stride(-1) == 1 && t.stride(-2) == t.size(-1),
              name, " must have contiguous [num_kv_heads, head_dim] rows");
}

void write_one(at::Tensor& cache, const at::Tensor& rows, const int64_t* blocks, const int64_t* offsets) {
  const int64_t T = rows.size(0), row_bytes = rows.size(1) * rows.size(2) * rows.element_size();
  const int64_t num_blocks = cache.size(0), block_size = cache.size(1);
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  const int64_t db = cache.stride(0) * cache.element_size(), doff = cache.stride(1) * cache.element_size();
  const int64_t dt = rows.stride(0) * rows.element_size();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(blocks[t] >= 0 && blocks[t] < num_blocks && offsets[t] >= 0 && offsets[t] < block_size,
                "slot (", blocks[t], ", ", offsets[t], ") is outside the cache's ", num_blocks, " x ", block_size);
    std::memcpy(dst + blocks[t] * db + offsets[t] * doff, src + t * dt, row_bytes);
  }
}

void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& blocks, const at::Tensor& offsets) {
  check_rows(k_cache, 4, "k_cache");
  check_rows(v_cache, 4, "v_cache");
  check_rows(k, 3, "k");
  check_rows(v, 3, "v");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "k and v must have the cache's dtype");
  TORCH_CHECK(k.sizes().slice(1) == k_cache.sizes().slice(2) && v.sizes().slice(1) == v_cache.sizes().slice(2),
              "k and v rows must be the cache's [num_kv_heads, head_dim]");
  const int64_t T = k.size(0);
  TORCH_CHECK(v.size(0) == T && blocks.dim() == 1 && offsets.dim() == 1 && blocks.size(0) == T && offsets.size(0) == T &&
                  blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong,
              "blocks and offsets must be long [T], one slot per row of k and v");
  const auto b = blocks.contiguous(), o = offsets.contiguous();
  write_one(k_cache, k, b.data_ptr<int64_t>(), o.data_ptr<int64_t>());
  write_one(v_cache, v, b.data_ptr<int64_t>(), o.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor blocks, Tensor offsets) -> ()");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("write_kv", &write_kv); }
