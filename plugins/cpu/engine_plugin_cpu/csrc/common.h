/* AVX-512 (F, BW, VL, BF16, VNNI) kernels for the CPU plugin's small-batch path, called through ctypes.
 *
 * Why C: at batch 1 a decode step is hundreds of tiny torch ops whose dispatch costs more than their
 * arithmetic, and torch's int4 kernel dequantises through float32. These kernels do one op per call on
 * bf16 activations, accumulating in int32 / float32.
 *
 * Quantized weights stay quantized (GGUF Q4_0 / Q4_1 / Q8_0 blocks, regrouped at load time, see
 * quantized_linear.c) and are multiplied with AVX-512 VNNI on two int8 levels of the activations.
 *
 * Files: common.h (conversions, vector math, the pool's API), thread_pool.c, quantized_linear.c,
 * small_ops.c (norms, SiLU-and-mul, rotary), paged_decode.c. They build into one shared library.
 */
#ifndef ENGINE_CPU_KERNELS_COMMON_H
#define ENGINE_CPU_KERNELS_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

#define Q4_BLOCK 32

typedef void (*task_fn)(void *ctx, int tid, int nthreads);

/* Run fn(ctx, tid, nthreads) on the caller (tid 0) and nthreads - 1 pool workers; returns when all are done. */
void pool_run(void *pool, task_fn fn, void *ctx, int nthreads);

/* The OpenMP runtime torch runs its ops on, by three of its entry points (found by the caller). */
typedef struct {
    void (*parallel)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags); /* GOMP_parallel */
    int (*thread_num)(void);                                                               /* omp_get_thread_num */
    int (*num_threads)(void);                                                              /* omp_get_num_threads */
} omp_team_t;

/* Run fn(ctx, tid, nthreads) as one parallel region of that runtime's team (its workers are the ones
 * torch's last op left spinning); the pool's threads when team is NULL. */
void team_run(const omp_team_t *team, void *pool, task_fn fn, void *ctx, int nthreads);

static inline void split_range(int64_t n, int tid, int nthreads, int64_t *lo, int64_t *hi) {
    int64_t chunk = (n + nthreads - 1) / nthreads;
    *lo = chunk * tid;
    *hi = *lo + chunk < n ? *lo + chunk : n;
    if (*lo > n) *lo = n;
}


static inline float bf16_to_float(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                         /* round to nearest even */
    return (bf16_t)(u >> 16);
}

static inline __m512 load_bf16x16(const bf16_t *p) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline __m512 maskload_bf16x16(const bf16_t *p, __mmask16 m) {
    __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline __m256i to_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static inline void store_bf16x16(bf16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, to_bf16x16(v)); }

static inline void maskstore_bf16x16(bf16_t *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, to_bf16x16(v));
}

static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* e^x for float32 lanes: 2^n * P(r), |r| <= ln2/2, degree-6 Taylor (relative error ~2e-7) */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
