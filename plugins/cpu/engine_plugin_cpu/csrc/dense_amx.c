/* Dense bf16 linear layers y = act(x W^T + b) on AMX tiles, the bias and activation (none, GELU) applied
 * while the product is in cache.
 *
 * Why: oneDNN's GELU post-op costs as much as a separate pass (2.2 ms of bge-small's 4.6 ms up projection,
 * 8,192 rows, on a 2-core Xeon). Here the epilogue of one 32 x 32 output block runs on the vector units
 * while the tile unit computes the next block: the epilogue's rows are spread over the next block's tile
 * steps, which hides most of it (the same projection with GELU: 3.0 ms; without, about oneDNN's time).
 * A residual add + LayerNorm epilogue was tried the same way and saved 2-7% against the product followed
 * by add_layer_norm_bf16: its vector work is about as long as the tile work it would hide behind.
 *
 * The weight is packed once (pack_amx_weight in amx_kernels.py) as B tiles: pairs of 32 output columns,
 * for each the K / 32 chunks, for each the two 16-column tiles [pairs][K/32][2][16 x 32]. A thread takes
 * 32 rows of x (two A tiles) and walks the column pairs of one column split, four accumulators (2 x 2
 * tiles). A split holds at most PANEL_BYTES of weight tiles, which stay in L2 while every row block
 * reads them (the threads take a split's blocks before the next split's). The weight tiles are loaded
 * with the streaming hint (tileloaddt1): each is read once per 32 rows, and keeping them out of L1 keeps
 * the rows of x there (measured: 1.9 against 2.7 ms for bge-small's q/k/v).
 */
#include "amx.h"

#define MROWS 32 /* rows of x a block takes: two A tiles */
#define PANEL_BYTES (1 << 20) /* most weight bytes one column split reads */
#define EPILOGUE_NONE 0
#define EPILOGUE_GELU 1

typedef struct {
    const bf16_t *x, *w, *bias;
    bf16_t *out;
    int64_t x_stride, out_stride; /* elements between rows */
    int64_t m, n, k, pairs, splits, pairs_per_split;
    int epilogue;
    atomic_int failed;
    atomic_llong next; /* the next (row block, column split) task */
} dense_args_t;

typedef struct {
    float *c[2];  /* [32][32] the accumulators of the last two column pairs */
    bf16_t *xpad; /* [32][k] a partial row block, zero below its rows */
} dense_scratch_t;

static inline __m512 load_bias16(const bf16_t *bias, int64_t col, int64_t n) {
    return bias ? maskload_bf16x16(bias + col, tail_mask(n - col)) : _mm512_setzero_ps();
}

/* GELU in its tanh form, x / (1 + 2^(-k x (1 + 0.044715 x^2))): at most 4.7e-4 from erf's, a thirtieth of
 * a bf16 rounding at that size; rcp14 (relative error 2^-14) is enough for a bf16 result, and a huge
 * power (x very negative) gives inf, whose reciprocal is 0 */
AMX_TARGET static inline __m512 gelu16(__m512 x) {
    const __m512 k = _mm512_set1_ps(-2.30220819f); /* -2 sqrt(2 / pi) / ln 2 */
    __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_mul_ps(k, _mm512_set1_ps(0.044715f)), k);
    t = _mm512_mul_ps(t, x);
    return _mm512_mul_ps(x, _mm512_rcp14_ps(_mm512_add_ps(exp2_fast(t), _mm512_set1_ps(1.0f))));
}

/* rows [lo, hi) of column pair q's accumulators (c) through the epilogue to out */
#define ALWAYS_INLINE inline __attribute__((always_inline))
AMX_TARGET static ALWAYS_INLINE void epilogue_rows(const dense_args_t *a, const float *c, int64_t row0, int64_t rows, int64_t q,
                                                   int64_t lo, int64_t hi, const int epilogue) {
    const int64_t col = q * 32;
    const __mmask16 m0 = tail_mask(a->n - col), m1 = col + 16 < a->n ? tail_mask(a->n - col - 16) : 0;
    const __m512 b0 = load_bias16(a->bias, col, a->n), b1 = m1 ? load_bias16(a->bias, col + 16, a->n) : _mm512_setzero_ps();
    if (hi > rows) hi = rows;
    for (int64_t i = lo; i < hi; i++) {
        __m512 v0 = _mm512_add_ps(_mm512_load_ps(c + i * 32), b0), v1 = _mm512_add_ps(_mm512_load_ps(c + i * 32 + 16), b1);
        if (epilogue == EPILOGUE_GELU) {
            v0 = gelu16(v0);
            v1 = gelu16(v1);
        }
        bf16_t *o = a->out + (row0 + i) * a->out_stride + col;
        if (m0 == 0xFFFF && m1 == 0xFFFF)
            _mm512_storeu_si512((void *)o, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
        else {
            maskstore_bf16x16(o, m0, v0);
            if (m1) maskstore_bf16x16(o + 16, m1, v1);
        }
    }
}

/* one task: rows [row0, row0 + rows) by column pairs [p0, p1). The previous pair's epilogue is spread
 * over the current pair's tile steps, so that the vector units work while the tile unit multiplies. */
AMX_TARGET static ALWAYS_INLINE void dense_task_with(const dense_args_t *a, dense_scratch_t *sc, int64_t row0, int64_t rows, int64_t p0,
                                                     int64_t p1, const int epilogue) {
    const int64_t kc_n = a->k / 32;
    const bf16_t *x0 = a->x + row0 * a->x_stride;
    int64_t x_bytes = a->x_stride * 2;
    if (rows < MROWS) { /* a partial block: its rows copied, the rest zero */
        memset(sc->xpad, 0, MROWS * a->k * 2);
        for (int64_t i = 0; i < rows; i++) memcpy(sc->xpad + i * a->k, x0 + i * a->x_stride, a->k * 2);
        x0 = sc->xpad;
        x_bytes = a->k * 2;
    }
    const bf16_t *x1 = (const bf16_t *)((const char *)x0 + TROWS * x_bytes);
    const int64_t per_step = (MROWS + kc_n - 1) / kc_n; /* epilogue rows per tile step */
    for (int64_t p = p0; p <= p1; p++) {
        const int64_t q = p - 1; /* the pair whose epilogue runs now */
        const float *cq = sc->c[q & 1];
        int64_t done = 0;
        if (p < p1) {
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(5);
            _tile_zero(6);
            const bf16_t *w = a->w + p * kc_n * 1024;
            for (int64_t kc = 0; kc < kc_n; kc++) {
                _tile_loadd(0, x0 + kc * 32, x_bytes);
                _tile_stream_loadd(1, w + kc * 1024, 64);
                _tile_dpbf16ps(2, 0, 1);
                _tile_stream_loadd(4, w + kc * 1024 + 512, 64);
                _tile_dpbf16ps(3, 0, 4);
                _tile_loadd(7, x1 + kc * 32, x_bytes);
                _tile_dpbf16ps(5, 7, 1);
                _tile_dpbf16ps(6, 7, 4);
                if (p > p0 && done < MROWS) {
                    epilogue_rows(a, cq, row0, rows, q, done, done + per_step, epilogue);
                    done += per_step;
                }
            }
        }
        if (p > p0 && done < MROWS) epilogue_rows(a, cq, row0, rows, q, done, MROWS, epilogue);
        if (p < p1) {
            float *c = sc->c[p & 1];
            _tile_stored(2, c, 128);
            _tile_stored(3, c + 16, 128);
            _tile_stored(5, c + TROWS * 32, 128);
            _tile_stored(6, c + TROWS * 32 + 16, 128);
        }
    }
}

/* dense_task_with, compiled once per epilogue (its branches folded) */
AMX_TARGET static void dense_task(const dense_args_t *a, dense_scratch_t *sc, int64_t row0, int64_t rows, int64_t p0, int64_t p1) {
    switch (a->epilogue) {
    case EPILOGUE_GELU: dense_task_with(a, sc, row0, rows, p0, p1, EPILOGUE_GELU); break;
    default: dense_task_with(a, sc, row0, rows, p0, p1, EPILOGUE_NONE);
    }
}

AMX_TARGET static void dense_worker(void *ctx, int tid, int nthreads) {
    dense_args_t *a = (dense_args_t *)ctx;
    (void)tid;
    (void)nthreads;
    const size_t c = MROWS * 32 * sizeof(float), xpad = (size_t)MROWS * a->k * 2;
    char *buf = aligned_alloc(64, (2 * c + xpad + 63) / 64 * 64);
    if (!buf) {
        atomic_store(&a->failed, 1); /* the other threads take the remaining tasks; the call still fails */
        return;
    }
    dense_scratch_t sc = {{(float *)buf, (float *)(buf + c)}, (bf16_t *)(buf + 2 * c)};
    amx_configure();
    const int64_t blocks = (a->m + MROWS - 1) / MROWS;
    const long long tasks = blocks * a->splits;
    /* tasks taken one at a time: a thread sharing its core with a spinning OpenMP worker (see
     * encoder_attention.c) must not hold back a fixed share */
    for (long long t; (t = atomic_fetch_add(&a->next, 1)) < tasks;) {
        /* column split by column split: the threads share one split's weight tiles, read from L2 */
        const int64_t split = t / blocks, block = t % blocks, row0 = block * MROWS;
        const int64_t p0 = split * a->pairs_per_split, p1 = p0 + a->pairs_per_split < a->pairs ? p0 + a->pairs_per_split : a->pairs;
        if (p0 < p1) dense_task(a, &sc, row0, a->m - row0 < MROWS ? a->m - row0 : MROWS, p0, p1);
    }
    _tile_release();
    free(buf);
}

/* y = epilogue(x W^T + b) for bf16 x [m, k] (rows x_stride apart, k a multiple of 32) and a packed weight
 * of n output columns (see the header); bias may be NULL. epilogue: 0 none, 1 GELU. Needs amx_request()
 * done. Returns 0, or -1 when a thread could not allocate its scratch. */
int dense_amx_bf16(void *pool, const omp_team_t *team, const bf16_t *x, int64_t x_stride, int64_t m, int64_t k,
                   const bf16_t *w, int64_t n, const bf16_t *bias, int epilogue, bf16_t *out, int64_t out_stride,
                   int nthreads) {
    const int64_t pairs = (n + 31) / 32, blocks = (m + MROWS - 1) / MROWS;
    if (blocks == 0 || pairs == 0) return 0;
    /* the columns split so that a split's weight tiles stay in L2 while every row block reads them
     * (SmolLM2's 3072 x 576 gate/up projection, 3.5 MB, read whole per block: 8.3 ms for 4,096 rows,
     * against 4.3 for oneDNN); few row blocks (a small batch) split their columns further, so that every
     * thread has work */
    const int64_t pair_bytes = k / 32 * 2048, panel_pairs = PANEL_BYTES / pair_bytes > 0 ? PANEL_BYTES / pair_bytes : 1;
    int64_t splits = (pairs + panel_pairs - 1) / panel_pairs;
    if (blocks * splits < 4 * (int64_t)nthreads) splits = (4 * (int64_t)nthreads + blocks - 1) / blocks;
    if (splits > pairs) splits = pairs;
    const int64_t per_split = (pairs + splits - 1) / splits;
    dense_args_t a = {x, w, bias, out, x_stride, out_stride, m, n, k, pairs, splits, per_split, epilogue, 0, 0};
    int64_t tasks = blocks * splits;
    if (nthreads > tasks) nthreads = (int)(tasks > 0 ? tasks : 1);
    team_run(team, pool, dense_worker, &a, nthreads);
    return -atomic_load(&a.failed);
}
