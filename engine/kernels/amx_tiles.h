// AMX tile plumbing shared by the engine's AMX kernels (int8_amx.cpp, int4_amx.cpp): the process's
// permission to use tile state, and the tile configuration record. Each kernel loads its own layout.
#pragma once

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

}  // namespace morphserve
