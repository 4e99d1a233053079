// AMX tiles (Sapphire Rapids on), shared by the kernels that use them (quant_gemm.cpp's
// many-row bf16 path, greedy_head.cpp's int8 pass; docs/cpu.md, "AMX tiles for many rows").
//
// Compiled into x86-64 builds with AVX512-BF16 (the amx class runs that variant), not the
// software AVX-512 of the tests. Linux grants the tile state to a process on request
// (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA); `amx_request` asks once, and `amx_wanted`
// says whether the many-row path should take the tiles (tests turn it off and on).

#pragma once

#if defined(__AVX512BF16__) && defined(__x86_64__) && !defined(RINGSERVE_EMULATE_AVX512)
#define RINGSERVE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace ringserve {

// NOTE: inline functions' statics are one object across the library's sources.
inline std::atomic<bool>& amx_granted_flag() {
  static std::atomic<bool> granted{false};
  return granted;
}

inline std::atomic<bool>& amx_wanted_flag() {
  static std::atomic<bool> wanted{false};
  return wanted;
}

// Asks Linux for the tile state (a CPU or kernel without AMX refuses); true once granted.
inline bool amx_request() {
  if (amx_granted_flag().load()) return true;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  if (ok) amx_granted_flag().store(true);
  return ok;
}

// Whether this process may execute tile instructions.
inline bool amx_granted() { return amx_granted_flag().load(std::memory_order_relaxed); }

// Whether the many-row bf16 path takes the tiles (granted and asked for).
inline bool amx_wanted() { return amx_wanted_flag().load(std::memory_order_relaxed); }

// The tile configuration (palette 1): each tile's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int nrows, int bytes) {
    rows[tile] = static_cast<uint8_t>(nrows);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
};

// Loads `c` on this thread (the tile state is a thread's own).
__attribute__((target("amx-tile"))) inline void amx_configure(const TileConfig& c) {
  // NOTE: GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the config, so
  // without this barrier the other 56 were never written (ldtilecfg then faulted).
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }

// Configures the tiles for a scope on this thread and releases them at its end.
struct AmxScope {
  explicit AmxScope(const TileConfig& c) { amx_configure(c); }
  ~AmxScope() { amx_release(); }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
};

}  // namespace ringserve

#endif  // RINGSERVE_AMX
