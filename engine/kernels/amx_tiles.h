// What the engine's AMX kernels (int8_amx.cpp, int4_amx.cpp) share: the process's permission to use tile
// state, the tile configuration record (each kernel loads its own layout), and reading bf16 rows as fp32.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace morphserve {

// Linux hands AMX tile state to a process only on request (arch_prctl); once per process.
inline bool amx_permitted() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  return ok;
}

// The 64-byte operand of ldtilecfg (palette 1): bytes per row and rows of each of the 8 tiles.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// 16 bf16 (raw bits) -> fp32, exact: bf16 is fp32's top half.
inline __m512 load_bf16(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}

}  // namespace morphserve
