/* What the AMX tile kernels share (encoder_attention.c, dense_amx.c): the target attribute, the tile
 * configuration, and the base-2 exponential their epilogues use.
 *
 * Tiles: every tile is 16 rows x 64 bytes. A (left) tiles are 16 rows of 32 bf16; B (right) tiles hold
 * 32 rows of the product's inner dimension as 16 rows of pairs (VNNI); C tiles 16 x 16 float32.
 */
#ifndef ENGINE_CPU_KERNELS_AMX_H
#define ENGINE_CPU_KERNELS_AMX_H

#include "common.h"

#define TROWS 16
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

/* Every tile 16 rows of 64 bytes, on the calling thread (each thread that uses tiles loads it). */
AMX_TARGET static inline void amx_configure(void) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = TROWS;
    }
    _tile_loadconfig(&cfg);
}

/* 2^t for t <= 0: 2^n p(f), n = round(t), f = t - n (vreduceps: independent of n), p a degree-3 fit of
 * 2^f on |f| <= 1/2 (relative error 7.5e-5, under a tenth of a bf16 rounding). scalef takes any n: a
 * very negative t gives 0 with no clamp; a positive t is exact as well, up to float32 overflow (inf). */
AMX_TARGET static inline __m512 exp2_fast(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.05517048f), f, _mm512_set1_ps(0.24260846f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69326097f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992824f));
    return _mm512_scalef_ps(p, n);
}

#endif
