// AMX tile helpers the AMX kernels share (gemm_amx.c, extend_attention.c). Built where the compiler
// targets AMX-BF16 (the amx level, relay/execution/kernels/isa.py); HAVE_AMX says whether it does.
#pragma once
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <immintrin.h>

// 1 where Linux granted this process AMX's tile state (gemm_amx.c asks on the first call).
int relay_gemm_amx_available(void);

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) AmxTileConfig;

// Tiles 0 .. count - 1 of 64 bytes a row; the first `short_tiles` of them `rows` rows, the rest 16.
static inline void amx_configure(int count, int short_tiles, int rows) {
    AmxTileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < count; t++) {
        c.colsb[t] = 64;
        c.rows[t] = (uint8_t)(t < short_tiles ? rows : 16);
    }
    _tile_loadconfig(&c);
}

// Tiles 0-3 to zero: the four C tiles the attention kernel accumulates in (tile numbers must be
// constants, so no loop).
static inline void amx_zero_tiles_0_to_3(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}
#else
#define HAVE_AMX 0
#endif
