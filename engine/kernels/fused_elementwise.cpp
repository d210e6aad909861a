// The elementwise work of a decoder layer on CPU, fused: RMSNorm, SiLU-and-multiply, and RoPE in place. torch runs each of these as 3-8 separate passes over the
// activations (casts, pow, mean, rsqrt, mul, cat, addcmul), each its own op call and, at 2 threads,
// its own fork/join; at a 512-token prefill chunk they cost about half as much as the layer's
// matmuls. Here each is one pass per row, fp32 inside, rounded to the tensor's dtype where torch
// rounds (so bf16 results match the torch path to the last bit, or within one bf16 rounding).
//
// Generic C++ that the compiler vectorizes for whatever -march it targets (no intrinsics), fp32 and
// bf16, rows split over torch's intra-op threads only when a call has enough work to pay for it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <bit>
#include <cmath>
#include <cstdint>

#include "simd_math.h"

namespace {

constexpr int64_t kMinElementsPerThread = 32768;  // below this a fork/join costs more than it saves

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }

// Round to nearest even, NaN kept a quiet NaN: the same bits as c10::BFloat16(float), branch-free.
template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    T out;
    out.x = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
    return out;
  }
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, op, ": the last dimension must be contiguous");
}

// Rows of a [..., n] tensor whose leading dimensions flatten to one stride (any contiguous tensor,
// a row slice of one): (number of rows, row stride).
std::pair<int64_t, int64_t> row_layout(const at::Tensor& x, const char* op) {
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  int64_t stride = x.dim() >= 2 ? x.stride(-2) : n;
  for (int64_t d = x.dim() - 2; d > 0; --d)
    TORCH_CHECK(x.size(d) == 1 || x.stride(d - 1) == x.stride(d) * x.size(d), op, ": rows must be evenly strided");
  return {rows, stride};
}

template <typename F>
void for_rows(int64_t rows, int64_t row_elems, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, row_elems));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r);
  });
}

// HF's RMSNorm of one row given its sum of squares: y = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype).
template <typename T>
inline void write_normed(const T* a, const T* w, T* o, int64_t n, float ss, float eps) {
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(to_float(w[i]) * to_float(from_float<T>(to_float(a[i]) * inv)));
}

// A row's sum of squares in fp32. One loop for rms_norm and add_rms_norm alike: how the compiler
// vectorizes a reduction sets its summation order, and a sum taken inside add_rms_norm's add loop was
// ordered differently on an AVX2-only CPU (bf16 there has no vector conversion), so its rows differed
// from rms_norm's in the last bit.
template <typename T>
inline float sum_squares(const T* a, int64_t n) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += to_float(a[i]) * to_float(a[i]);
  return ss;
}

// HF's RMSNorm, the mean in fp32.
template <typename T>
void norm_rows(const T* x, int64_t x_s, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  for_rows(rows, n, [&](int64_t r) {
    const T* a = x + r * x_s;
    write_normed(a, w, out + r * n, n, sum_squares(a, n), eps);
  });
}

template <typename F>
void by_dtype(const at::Tensor& x, const F& f) {
  if (x.scalar_type() == at::kFloat) f(float{});
  else f(c10::BFloat16{});
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "rms_norm: weight must be [hidden] contiguous, x's dtype");
  const auto [rows, stride] = row_layout(x, "rms_norm");
  auto out = at::empty(x.sizes(), x.options());
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(x.data_ptr<T>(), stride, weight.data_ptr<T>(), out.data_ptr<T>(), rows,
                 x.size(-1), static_cast<float>(eps));
  });
  return out;
}

// The residual add fused into the norm that follows it (vLLM's fused_add_rms_norm): h = x + residual
// rounded to dtype as torch's add rounds it, y = rms_norm(h); one pass reads both inputs and writes
// both outputs, where the add alone was a pass of its own. Returns (y, h).
template <typename T>
void add_norm_rows(const T* x, int64_t x_s, const T* res, int64_t r_s, const T* w, T* out, T* sum, int64_t rows,
                   int64_t n, float eps) {
  for_rows(rows, n, [&](int64_t r) {
    const T* a = x + r * x_s;
    const T* b = res + r * r_s;
    T* h = sum + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) h[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
    write_normed(h, w, out + r * n, n, sum_squares(h, n), eps);  // h is still in L1
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm: x and residual must have the same shape and dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "add_rms_norm: weight must be [hidden] contiguous, x's dtype");
  const auto [rows, x_s] = row_layout(x, "add_rms_norm");
  const auto r_s = row_layout(residual, "add_rms_norm").second;
  auto out = at::empty(x.sizes(), x.options());
  auto sum = at::empty(x.sizes(), x.options());
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    add_norm_rows<T>(x.data_ptr<T>(), x_s, residual.data_ptr<T>(), r_s, weight.data_ptr<T>(), out.data_ptr<T>(),
                     sum.data_ptr<T>(), rows, x.size(-1), static_cast<float>(eps));
  });
  return {out, sum};
}

// x: [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]; silu rounded to dtype before the product, as
// torch's F.silu(gate) * up does.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2 * I]");
  const int64_t rows = x.size(0), half = x.size(1) / 2, stride = x.stride(0);
  auto out = at::empty({rows, half}, x.options());
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const T* src = x.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    for_rows(rows, 2 * half, [&](int64_t r) {
      const T* g = src + r * stride;
      const T* u = g + half;
      T* o = dst + r * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float v = to_float(g[i]);
        const float act = to_float(from_float<T>(v / (1.f + morphserve::exp_approx(-v))));
        o[i] = from_float<T>(act * to_float(u[i]));
      }
    });
  });
  return out;
}

// In place, x: [T, H, D] (any heads side by side, e.g. q and k of a fused qkv output), Hugging Face's
// rotate_half convention: [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin] with cos/sin rows
// [max_positions, D] of the model dtype; computed in fp32, rounded once.
void rotary_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rotary_");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "rotary_: x must be [T, H, D] with an even D");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == x.size(0) &&
              positions.is_contiguous(), "rotary_: positions must be [T] contiguous int64");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == x.size(2) && cos.is_contiguous() &&
              sin.is_contiguous() && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_: cos and sin must be [max_positions, D] contiguous, x's dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_: position ", pos[t], " is beyond the cos/sin tables");
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    T* base = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    for_rows(tokens, heads * dim, [&](int64_t t) {
      const T* c = cp + pos[t] * dim;
      const T* s = sp + pos[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = base + t * s0 + h * s1;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(v[i]), b = to_float(v[half + i]);
          v[i] = from_float<T>(a * to_float(c[i]) - b * to_float(s[i]));
          v[half + i] = from_float<T>(b * to_float(c[half + i]) + a * to_float(s[half + i]));
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
}
