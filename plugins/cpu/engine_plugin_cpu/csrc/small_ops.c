/* Element-wise and per-row ops on bf16 rows, computed in float32. */
#include "common.h"


static inline float sum_squares_bf16(const bf16_t *x, int64_t h) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= h; i += 16) {
        __m512 v = load_bf16x16(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    if (i < h) {
        __m512 v = maskload_bf16x16(x + i, tail_mask(h - i));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static void scale_row_bf16(const bf16_t *x, const bf16_t *weight, bf16_t *out, int64_t h, float rstd) {
    __m512 s = _mm512_set1_ps(rstd);
    for (int64_t i = 0; i < h; i += 16) {
        __mmask16 m = tail_mask(h - i);
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(maskload_bf16x16(x + i, m), s), maskload_bf16x16(weight + i, m));
        maskstore_bf16x16(out + i, m, v);
    }
}

/* out = rms_norm(x) * weight; rows of h contiguous bf16 values */
void rms_norm_bf16(const bf16_t *x, const bf16_t *weight, bf16_t *out, int64_t rows, int64_t h, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float rstd = 1.0f / sqrtf(sum_squares_bf16(x + r * h, h) / (float)h + eps);
        scale_row_bf16(x + r * h, weight, out + r * h, h, rstd);
    }
}

/* summed = x + residual in float32 (residual bf16, or float32 when residual_f32); out = rms_norm(summed) *
 * weight in bf16. Keeping the residual stream in float32 removes a bf16 rounding per layer and norm. */
void add_rms_norm_f32(const bf16_t *x, const void *residual, int residual_f32, const bf16_t *weight, bf16_t *out,
                      float *summed, int64_t rows, int64_t h, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *xr = x + r * h;
        float *sr = summed + r * h;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 16) {
            __mmask16 m = tail_mask(h - i);
            __m512 res = residual_f32 ? _mm512_maskz_loadu_ps(m, (const float *)residual + r * h + i)
                                      : maskload_bf16x16((const bf16_t *)residual + r * h + i, m);
            __m512 v = _mm512_add_ps(maskload_bf16x16(xr + i, m), res);
            _mm512_mask_storeu_ps(sr + i, m, v);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        __m512 s = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)h + eps));
        for (int64_t i = 0; i < h; i += 16) {
            __mmask16 m = tail_mask(h - i);
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + i), s), maskload_bf16x16(weight + i, m));
            maskstore_bf16x16(out + r * h + i, m, v);
        }
    }
}

/* out[r, :d] = silu(x[r, :d]) * x[r, d:] */
void silu_and_mul_bf16(const bf16_t *x, bf16_t *out, int64_t rows, int64_t d) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *g = x + r * 2 * d, *u = g + d;
        bf16_t *o = out + r * d;
        for (int64_t i = 0; i < d; i += 16) {
            __mmask16 m = tail_mask(d - i);
            __m512 gv = maskload_bf16x16(g + i, m);
            __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            maskstore_bf16x16(o + i, m, _mm512_mul_ps(silu, maskload_bf16x16(u + i, m)));
        }
    }
}

/* Rotate-half rotary embedding: dst[t] (contiguous [heads, head_dim]) is the rotation of the heads at
 * src + t * src_stride; cos_sin is float32 [num_positions, head_dim] (cos half, then sin half).
 * Returns -1, writing nothing, when a position is outside the table. */
int rotary_bf16(const bf16_t *src, int64_t src_stride, bf16_t *dst, const int64_t *positions, const float *cos_sin,
                int64_t num_positions, int64_t tokens, int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const bf16_t *v = src + t * src_stride + h * head_dim;
            bf16_t *o = dst + (t * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i += 16) {
                __mmask16 m = tail_mask(half - i);
                __m512 c = _mm512_maskz_loadu_ps(m, cs + i), s = _mm512_maskz_loadu_ps(m, cs + half + i);
                __m512 x1 = maskload_bf16x16(v + i, m), x2 = maskload_bf16x16(v + half + i, m);
                maskstore_bf16x16(o + i, m, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)));
                maskstore_bf16x16(o + half + i, m, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)));
            }
        }
    }
    return 0;
}

typedef struct {
    const bf16_t *x, *residual, *weight, *bias; /* bias may be NULL */
    bf16_t *out;
    int64_t rows, h;
    float eps;
} add_layer_norm_args_t;

static void add_layer_norm_rows(void *ctx, int tid, int nthreads) {
    const add_layer_norm_args_t *a = ctx;
    const int64_t h = a->h;
    int64_t lo, hi;
    split_range(a->rows, tid, nthreads, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const bf16_t *xr = a->x + r * h, *rr = a->residual + r * h;
        bf16_t *o = a->out + r * h;
        /* the sum rounded to bf16 first, as the unfused x + residual would be; kept in the output row */
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 16) {
            const __mmask16 m = tail_mask(h - i);
            const __m256i rounded = to_bf16x16(_mm512_add_ps(maskload_bf16x16(xr + i, m), maskload_bf16x16(rr + i, m)));
            _mm256_mask_storeu_epi16(o + i, m, rounded);
            acc = _mm512_add_ps(acc, maskload_bf16x16(o + i, m));
        }
        const float mean = _mm512_reduce_add_ps(acc) / (float)h;
        const __m512 vmean = _mm512_set1_ps(mean);
        __m512 var = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 16) {
            const __mmask16 m = tail_mask(h - i);
            const __m512 c = _mm512_maskz_sub_ps(m, maskload_bf16x16(o + i, m), vmean);
            var = _mm512_fmadd_ps(c, c, var);
        }
        const __m512 rstd = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(var) / (float)h + a->eps));
        for (int64_t i = 0; i < h; i += 16) {
            const __mmask16 m = tail_mask(h - i);
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(maskload_bf16x16(o + i, m), vmean), rstd),
                                     maskload_bf16x16(a->weight + i, m));
            if (a->bias) v = _mm512_add_ps(v, maskload_bf16x16(a->bias + i, m));
            maskstore_bf16x16(o + i, m, v);
        }
    }
}

/* out = layer_norm(x + residual) * weight + bias in bf16 (statistics in float32), rows split over the
 * team (torch's OpenMP workers, which the product before it left spinning) or the pool */
void add_layer_norm_bf16(void *pool, const omp_team_t *team, const bf16_t *x, const bf16_t *residual, const bf16_t *weight,
                         const bf16_t *bias, bf16_t *out, int64_t rows, int64_t h, float eps, int nthreads) {
    add_layer_norm_args_t a = {x, residual, weight, bias, out, rows, h, eps};
    team_run(team, pool, add_layer_norm_rows, &a, rows >= 64 ? nthreads : 1);
}
