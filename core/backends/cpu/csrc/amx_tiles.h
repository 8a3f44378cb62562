// AMX tiles for the CPU kernels: whether the build targets them (CONVEYOR_AMX), and the one tile
// configuration conveyor uses (eight tiles of 16 rows x 64 bytes). `amx_gemm_available()`
// (amx_gemm.cpp) says whether they may run here.
#pragma once
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define CONVEYOR_AMX 1
#include <immintrin.h>
#endif

bool amx_gemm_available();  // AMX compiled in and the tile registers granted by the kernel

#ifdef CONVEYOR_AMX
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7, each 16 rows x 64 bytes (16 floats, or 32 bf16 / 16 bf16 pairs), on this thread.
// LDTILECFG is issued here rather than through `_tile_loadconfig`: GCC 12's intrinsic tells the
// compiler it reads only the first 8 bytes of the configuration, so at -O2/-O3 the stores of the
// rows and column widths may be dropped as dead, and the first tile instruction then faults
// (SIGILL). Naming the whole 64-byte block as the input keeps them.
static inline void amx_tile_config() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// The tiles of the products path of paged attention (paged_attention.cpp, attend_tiles): 0-3 of
// 16 rows x 64 bytes (scores, q, K pair rows; then the P . V outputs), 4 of 16 rows x 32 bytes (the
// probabilities of 16 vectors for one block of 16 keys), 5-7 of 8 rows x 64 bytes (a block's V pair
// rows for 16 dims: 8 key pairs).
static inline void amx_attention_tile_config() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t < 5 ? 16 : 8;
  }
  cfg.colsb[4] = 32;
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}
#endif
