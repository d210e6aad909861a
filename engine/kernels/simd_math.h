// Small float helpers shared by the engine's kernels, written so that the loops calling them vectorize
// (no library calls, no branches) for whatever -march the library is built for.
#pragma once

#include <bit>
#include <cstdint>

namespace morphserve {

// exp(x) for float, relative error ~2e-7 (a few float ulps): 2^n * p(r), |r| <= ln2/2, degree-6
// polynomial. Written without branches or library calls so the loops around it vectorize.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : x;  // not std::fmin/fmax: those are library calls that stop vectorization;
  x = x > 88.0f ? 88.0f : x;    // a NaN passes both tests and comes out NaN
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 split in two for exactness
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * std::bit_cast<float>(static_cast<int32_t>(n + 127.f) << 23);
}

}  // namespace morphserve
