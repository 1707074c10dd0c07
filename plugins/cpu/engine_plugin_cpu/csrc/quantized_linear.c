/* Quantized linear layers with AVX-512 VNNI.
 *
 * Weights are tiled 16 output rows at a time, so that each 32-bit lane of a 512-bit register belongs to
 * one output row: per (tile, 32-weight block) a record holds the block's weights for the 16 rows,
 * then their fp16 scales. A product needs no horizontal sums and no per-block shuffles.
 *
 * Activations are split per 32-value block into two int8 levels, x ~= s * (xh + xl / 256) with
 * s = max|x| / 127, i.e. about 15 bits relative to the block's largest value, finer than bf16's 8 bits
 * per value, so these products are at least as accurate as the bf16 dense ones. Both levels go through
 * vpdpbusd (unsigned weight bytes times signed activation bytes).
 *
 * 4-bit record (320 bytes): 4 chunks of 64 bytes; in chunk c, lane i (row 16t + i) holds 4 bytes whose
 * byte j has weight k = 8c + j in its low nibble and k = 8c + 4 + j in its high one (q in 0..15); then
 * 16 fp16 d and 16 fp16 m, w = d * q + m.
 * 8-bit record (544 bytes): 8 chunks; in chunk c, lane i holds weights k = 4c .. 4c + 3 of row 16t + i as
 * q + 128 (unsigned); then 16 fp16 d, w = d * q.
 * 6-bit record (576 bytes, GGUF Q6_K, whose scales cover 16 weights): the 8-bit layout with q in -32..31,
 * then 16 fp16 scales of weights 0-15 and 16 of weights 16-31 (GGUF's d times the sub-block's scale).
 * 5-bit record (576 bytes, GGUF Q5_K): the 8-bit layout with q in 0..31 as it is (no offset), then 16 fp16 d
 * and 16 fp16 m, w = d * q + m.
 * IQ4 record (320 bytes, GGUF IQ4_NL / IQ4_XS): the 4-bit layout whose nibbles index the format's table of 16
 * int8 values (a byte shuffle gives them plus 128, removed again through the activations' correction), then 16
 * fp16 d (m unread), w = d * table[q].
 * 2-bit record (640 bytes, GGUF Q2_K, whose scales and mins cover 16 weights): the 6-bit record with q in 0..3,
 * then 16 fp16 m of weights 0-15 and 16 of weights 16-31, w = d * q + m; m multiplies the half's activation sum
 * as the products see it (the quantized levels' sum, which the offset correction holds already).
 */
#include "common.h"

#define TILE_ROWS 16
#define Q4_TILE_RECORD 320
#define Q8_TILE_RECORD 544
#define Q6_TILE_RECORD 576
#define Q5_TILE_RECORD 576
#define Q2_TILE_RECORD 640

typedef struct {
    int8_t *xh, *xl;           /* [rows][k] */
    float *scale;              /* [rows][blocks]: s / 256 */
    float *xsum;               /* [rows][blocks]: sum of the block's values */
    int32_t *bias_correction;  /* [rows][blocks][2]: 128 * (256 * sum(xh) + sum(xl)) over each 16-value half,
                                  to remove the +128 of unsigned 8-bit weights */
    void *buffer;
} activations_t;

static int prepare_activations(const bf16_t *x, int64_t rows, int64_t k, activations_t *a) {
    const int64_t nblk = k / Q4_BLOCK;
    size_t bytes = (size_t)(rows * k * 2) + (size_t)(rows * nblk) * 16 + 64;
    a->buffer = malloc(bytes);
    if (!a->buffer) return -1;
    a->xh = a->buffer;
    a->xl = a->xh + rows * k;
    a->scale = (float *)(((uintptr_t)(a->xl + rows * k) + 15) & ~(uintptr_t)15);
    a->xsum = a->scale + rows * nblk;
    a->bias_correction = (int32_t *)(a->xsum + rows * nblk);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nblk; b++) {
            const bf16_t *src = x + r * k + b * Q4_BLOCK;
            __m512 v0 = load_bf16x16(src), v1 = load_bf16x16(src + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const int64_t idx = r * nblk + b;
            a->scale[idx] = amax / 127.0f / 256.0f;
            a->xsum[idx] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
            for (int half = 0; half < 2; half++) {
                __m512 y = _mm512_mul_ps(half ? v1 : v0, _mm512_set1_ps(inv));
                __m512 yh = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                __m512 yl = _mm512_mul_ps(_mm512_sub_ps(y, yh), _mm512_set1_ps(256.0f));
                yl = _mm512_max_ps(_mm512_min_ps(yl, _mm512_set1_ps(127.0f)), _mm512_set1_ps(-127.0f));
                __m512i ih = _mm512_cvtps_epi32(yh), il = _mm512_cvtps_epi32(yl);
                a->bias_correction[2 * idx + half] =
                    128 * (256 * _mm512_reduce_add_epi32(ih) + _mm512_reduce_add_epi32(il));
                _mm_storeu_si128((__m128i *)(a->xh + r * k + b * Q4_BLOCK + 16 * half), _mm512_cvtepi32_epi8(ih));
                _mm_storeu_si128((__m128i *)(a->xl + r * k + b * Q4_BLOCK + 16 * half), _mm512_cvtepi32_epi8(il));
            }
        }
    }
    return 0;
}

typedef struct {
    const activations_t *act;
    const uint8_t *w;
    void *out; /* bf16, or float32 when out_f32 */
    int64_t rows, n, k;
    int out_f32;
} qlinear_args_t;

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline void store_tile(const qlinear_args_t *a, int64_t t, int64_t r, __m512 v) {
    const __mmask16 m = tail_mask(a->n - t * TILE_ROWS);
    const int64_t at = r * a->n + t * TILE_ROWS;
    if (a->out_f32) _mm512_mask_storeu_ps((float *)a->out + at, m, v);
    else maskstore_bf16x16((bf16_t *)a->out + at, m, v);
}

/* total + (256 h + l - correction) * d * s: a block's two activation levels' int32 products per lane,
 * less the unsigned-weight offset, scaled by the weights' d and the activations' s / 256 */
static inline __m512 add_block(__m512 total, __m512i h, __m512i l, int32_t correction, __m512 d, float s) {
    __m512i both = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l), _mm512_set1_epi32(correction));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(d, _mm512_set1_ps(s)), total);
}

/* one 16-row tile of 4-bit weights against R activation rows from r0: w = d * q + m or, with lut, the IQ4
 * table's value of q (plus 128) times d */
static inline __attribute__((always_inline)) void nibble_tile(const qlinear_args_t *a, int64_t t, int64_t r0,
                                                              const int R, const int lut) {
    const int64_t nblk = a->k / Q4_BLOCK;
    const activations_t *act = a->act;
    const uint8_t *rec = a->w + t * nblk * Q4_TILE_RECORD;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    /* IQ4's values -127, -104, ..., 113 plus 128, in each 128-bit lane for the shuffle */
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181,
                      (char)197, (char)217, (char)241));
    __m512 total[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++, rec += Q4_TILE_RECORD) {
        __m512i h0[4], h1[4], l0[4], l1[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) h0[r] = h1[r] = l0[r] = l1[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512((const void *)(rec + 64 * c));
            __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if (lut) {
                lo = _mm512_shuffle_epi8(table, lo);
                hi = _mm512_shuffle_epi8(table, hi);
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int64_t off = (r0 + r) * a->k + b * Q4_BLOCK + 8 * c;
                h0[r] = _mm512_dpbusd_epi32(h0[r], lo, _mm512_set1_epi32(load_i32(act->xh + off)));
                h1[r] = _mm512_dpbusd_epi32(h1[r], hi, _mm512_set1_epi32(load_i32(act->xh + off + 4)));
                l0[r] = _mm512_dpbusd_epi32(l0[r], lo, _mm512_set1_epi32(load_i32(act->xl + off)));
                l1[r] = _mm512_dpbusd_epi32(l1[r], hi, _mm512_set1_epi32(load_i32(act->xl + off + 4)));
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const int64_t idx = (r0 + r) * nblk + b;
            const int32_t correction = lut ? act->bias_correction[2 * idx] + act->bias_correction[2 * idx + 1] : 0;
            total[r] = add_block(total[r], _mm512_add_epi32(h0[r], h1[r]), _mm512_add_epi32(l0[r], l1[r]),
                                 correction, d, act->scale[idx]);
            if (!lut) total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(act->xsum[idx]), total[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) store_tile(a, t, r0 + r, total[r]);
}

/* one 16-row tile of 4-bit weights (Q4_0 / Q4_1 / Q4_K) */
static inline __attribute__((always_inline)) void q4_tile(const qlinear_args_t *a, int64_t t, int64_t r0, const int R) {
    nibble_tile(a, t, r0, R, 0);
}

/* one 16-row tile of IQ4 weights: 4-bit records whose nibbles index the IQ4 table */
static inline __attribute__((always_inline)) void iq4_tile(const qlinear_args_t *a, int64_t t, int64_t r0, const int R) {
    nibble_tile(a, t, r0, R, 1);
}

/* one 16-row tile of 8-bit records against R activation rows from r0: Q8_0's (q + 128, the offset removed
 * again through the activations' correction) or, with_min, Q5_K's (q as it is, then m times the block's
 * activation sum) */
static inline __attribute__((always_inline)) void byte_tile(const qlinear_args_t *a, int64_t t, int64_t r0, const int R,
                                                            const int64_t record, const int with_min) {
    const int64_t nblk = a->k / Q4_BLOCK;
    const activations_t *act = a->act;
    const uint8_t *rec = a->w + t * nblk * record;
    __m512 total[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++, rec += record) {
        __m512i h0[4], h1[4], l0[4], l1[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) h0[r] = h1[r] = l0[r] = l1[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 8; c += 2) {
            __m512i v0 = _mm512_loadu_si512((const void *)(rec + 64 * c));
            __m512i v1 = _mm512_loadu_si512((const void *)(rec + 64 * c + 64));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int64_t off = (r0 + r) * a->k + b * Q4_BLOCK + 4 * c;
                h0[r] = _mm512_dpbusd_epi32(h0[r], v0, _mm512_set1_epi32(load_i32(act->xh + off)));
                h1[r] = _mm512_dpbusd_epi32(h1[r], v1, _mm512_set1_epi32(load_i32(act->xh + off + 4)));
                l0[r] = _mm512_dpbusd_epi32(l0[r], v0, _mm512_set1_epi32(load_i32(act->xl + off)));
                l1[r] = _mm512_dpbusd_epi32(l1[r], v1, _mm512_set1_epi32(load_i32(act->xl + off + 4)));
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 512)));
        __m512 m = with_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 544))) : _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const int64_t idx = (r0 + r) * nblk + b;
            const int32_t correction =
                with_min ? 0 : act->bias_correction[2 * idx] + act->bias_correction[2 * idx + 1];
            total[r] = add_block(total[r], _mm512_add_epi32(h0[r], h1[r]), _mm512_add_epi32(l0[r], l1[r]),
                                 correction, d, act->scale[idx]);
            if (with_min) total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(act->xsum[idx]), total[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) store_tile(a, t, r0 + r, total[r]);
}

/* one 16-row tile of 8-bit (Q8_0) weights against R activation rows from r0 */
static inline __attribute__((always_inline)) void q8_tile(const qlinear_args_t *a, int64_t t, int64_t r0, const int R) {
    byte_tile(a, t, r0, R, Q8_TILE_RECORD, 0);
}

/* one 16-row tile of 5-bit (Q5_K) weights: 8-bit records of unsigned q with a d and an m per 32 weights */
static inline __attribute__((always_inline)) void q5_tile(const qlinear_args_t *a, int64_t t, int64_t r0, const int R) {
    byte_tile(a, t, r0, R, Q5_TILE_RECORD, 1);
}

/* one 16-row tile of 8-bit records whose two 16-weight halves have their own scale against R activation rows
 * from r0: Q6_K's or, with_min, Q2_K's (then an m per half times the half's activation sum) */
static inline __attribute__((always_inline)) void half_scaled_tile(const qlinear_args_t *a, int64_t t, int64_t r0,
                                                                   const int R, const int64_t record,
                                                                   const int with_min) {
    const int64_t nblk = a->k / Q4_BLOCK;
    const activations_t *act = a->act;
    const uint8_t *rec = a->w + t * nblk * record;
    __m512 total[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++, rec += record) {
        __m512i ha[4], hb[4], la[4], lb[4]; /* a: weights 0-15 (chunks 0-3), b: weights 16-31 */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) ha[r] = hb[r] = la[r] = lb[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m512i va = _mm512_loadu_si512((const void *)(rec + 64 * c));
            __m512i vb = _mm512_loadu_si512((const void *)(rec + 64 * c + 256));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int64_t off = (r0 + r) * a->k + b * Q4_BLOCK + 4 * c;
                ha[r] = _mm512_dpbusd_epi32(ha[r], va, _mm512_set1_epi32(load_i32(act->xh + off)));
                hb[r] = _mm512_dpbusd_epi32(hb[r], vb, _mm512_set1_epi32(load_i32(act->xh + off + 16)));
                la[r] = _mm512_dpbusd_epi32(la[r], va, _mm512_set1_epi32(load_i32(act->xl + off)));
                lb[r] = _mm512_dpbusd_epi32(lb[r], vb, _mm512_set1_epi32(load_i32(act->xl + off + 16)));
            }
        }
        __m512 da = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 512)));
        __m512 db = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 544)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const int64_t idx = (r0 + r) * nblk + b;
            total[r] = add_block(total[r], ha[r], la[r], act->bias_correction[2 * idx], da, act->scale[idx]);
            total[r] = add_block(total[r], hb[r], lb[r], act->bias_correction[2 * idx + 1], db, act->scale[idx]);
        }
        if (with_min) {
            __m512 ma = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 576)));
            __m512 mb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 608)));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int64_t idx = (r0 + r) * nblk + b;
                /* a half's sum of s / 256 * (256 xh + xl): its correction is 128 times the integer part */
                const float s = act->scale[idx] / 128.0f;
                total[r] = _mm512_fmadd_ps(ma, _mm512_set1_ps(s * (float)act->bias_correction[2 * idx]), total[r]);
                total[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(s * (float)act->bias_correction[2 * idx + 1]), total[r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) store_tile(a, t, r0 + r, total[r]);
}

/* one 16-row tile of 6-bit (Q6_K) weights: 8-bit records whose two 16-weight halves have their own scale */
static inline __attribute__((always_inline)) void q6_tile(const qlinear_args_t *a, int64_t t, int64_t r0, const int R) {
    half_scaled_tile(a, t, r0, R, Q6_TILE_RECORD, 0);
}

/* one 16-row tile of 2-bit (Q2_K) weights: Q6_K's records with an m per half */
static inline __attribute__((always_inline)) void q2_tile(const qlinear_args_t *a, int64_t t, int64_t r0, const int R) {
    half_scaled_tile(a, t, r0, R, Q2_TILE_RECORD, 1);
}

#define TILE_DISPATCH(fn)                                                         \
    static void fn##_task(void *ctx, int tid, int nthreads) {                     \
        const qlinear_args_t *a = ctx;                                            \
        int64_t lo, hi;                                                           \
        split_range((a->n + TILE_ROWS - 1) / TILE_ROWS, tid, nthreads, &lo, &hi); \
        for (int64_t r0 = 0; r0 < a->rows; r0 += 4) {                            \
            int64_t left = a->rows - r0;                                          \
            for (int64_t t = lo; t < hi; t++) {                                   \
                if (left >= 4) fn(a, t, r0, 4);                                   \
                else if (left == 3) fn(a, t, r0, 3);                              \
                else if (left == 2) fn(a, t, r0, 2);                              \
                else fn(a, t, r0, 1);                                             \
            }                                                                     \
        }                                                                         \
    }
TILE_DISPATCH(q4_tile)
TILE_DISPATCH(q8_tile)
TILE_DISPATCH(q6_tile)
TILE_DISPATCH(q5_tile)
TILE_DISPATCH(q2_tile)
TILE_DISPATCH(iq4_tile)

static int qlinear(void *pool, const omp_team_t *team, task_fn task, const bf16_t *x, const uint8_t *w, void *out,
                   int64_t rows, int64_t n, int64_t k, int out_f32, int nthreads) {
    activations_t act;
    if (prepare_activations(x, rows, k, &act) != 0) return -1;
    qlinear_args_t a = {&act, w, out, rows, n, k, out_f32};
    team_run(team, pool, task, &a, nthreads);
    free(act.buffer);
    return 0;
}

/* Each entry: out[rows, n] = x[rows, k] @ W^T for W in its tile records; x contiguous bf16, k % 32 == 0; out
 * contiguous bf16, or float32 when out_f32. Returns 0, or -1 when out of memory. */
#define QLINEAR_ENTRY(name, task)                                                                          \
    int name(void *pool, const omp_team_t *team, const bf16_t *x, const uint8_t *w, void *out, int64_t rows,  \
             int64_t n, int64_t k, int out_f32, int nthreads) {                                                 \
        return qlinear(pool, team, task, x, w, out, rows, n, k, out_f32, nthreads);                             \
    }
QLINEAR_ENTRY(q4_linear, q4_tile_task)   /* 4-bit records (Q4_0 / Q4_1 / Q4_K) */
QLINEAR_ENTRY(q8_linear, q8_tile_task)   /* 8-bit (Q8_0) */
QLINEAR_ENTRY(q6_linear, q6_tile_task)   /* 6-bit (Q6_K, Q3_K) */
QLINEAR_ENTRY(q5_linear, q5_tile_task)   /* 5-bit (Q5_K, Q5_1) */
QLINEAR_ENTRY(q2_linear, q2_tile_task)   /* 2-bit (Q2_K) */
QLINEAR_ENTRY(iq4_linear, iq4_tile_task) /* IQ4 (IQ4_NL / IQ4_XS) */
