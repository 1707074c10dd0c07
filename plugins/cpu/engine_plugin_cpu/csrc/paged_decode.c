/* Paged attention for decode rows (one query token per sequence) over a bf16 KV cache. */
#include "common.h"


typedef struct {
    const bf16_t *q, *k, *v;
    int64_t q_stride; /* elements between tokens of q */
    bf16_t *cache;               /* [2, blocks, block_size, kv_heads, head_dim] */
    int64_t num_blocks, block_size;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *seq_lens;
    const int64_t *slots;
    bf16_t *out; /* [seqs, heads, head_dim] */
    int64_t seqs, heads, kv_heads, head_dim;
    float scale, soft_cap;
    int64_t window;
    atomic_int failed; /* a thread could not allocate its score buffer */
} decode_args_t;

static inline float dot_bf16(const bf16_t *a, const bf16_t *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(a + i)),
                               (__m512bh)_mm512_loadu_si512((const void *)(b + i)));
    return _mm512_reduce_add_ps(acc);
}

/* one (sequence, kv head): its group of query heads over the whole context */
static void decode_one(const decode_args_t *a, int64_t s, int64_t g, float *scores) {
    const int64_t d = a->head_dim, group = a->heads / a->kv_heads, bs = a->block_size;
    const int64_t len = a->seq_lens[s];
    const int64_t token_stride = a->kv_heads * d;
    const bf16_t *kcache = a->cache, *vcache = a->cache + a->num_blocks * bs * token_stride;
    const int32_t *table = a->block_tables + s * a->table_stride;
    int64_t start = 0;
    if (a->window > 0 && len > a->window) start = len - a->window;
    for (int64_t j = 0; j < group; j++) {
        const int64_t h = g * group + j;
        const bf16_t *q = a->q + s * a->q_stride + h * d;
        float *sc = scores + j * len;
        float mx = -INFINITY;
        for (int64_t t = start; t < len; t++) {
            const int64_t slot = (int64_t)table[t / bs] * bs + t % bs;
            float x = dot_bf16(q, kcache + slot * token_stride + g * d, d) * a->scale;
            if (a->soft_cap > 0) x = a->soft_cap * tanhf(x / a->soft_cap);
            sc[t] = x;
            mx = x > mx ? x : mx;
        }
        float denom = 0.0f;
        for (int64_t t = start; t < len; t++) {
            sc[t] = expf(sc[t] - mx);
            denom += sc[t];
        }
        const float inv = len > start ? 1.0f / denom : 0.0f;
        bf16_t *o = a->out + (s * a->heads + h) * d;
        for (int64_t i = 0; i < d; i += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t t = start; t < len; t++) {
                const int64_t slot = (int64_t)table[t / bs] * bs + t % bs;
                acc = _mm512_fmadd_ps(_mm512_set1_ps(sc[t]), load_bf16x16(vcache + slot * token_stride + g * d + i),
                                      acc);
            }
            store_bf16x16(o + i, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
        }
    }
}

static void decode_task(void *ctx, int tid, int nthreads) {
    const decode_args_t *a = ctx;
    int64_t lo, hi, max_len = 0;
    split_range(a->seqs * a->kv_heads, tid, nthreads, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        int64_t len = a->seq_lens[i / a->kv_heads];
        max_len = len > max_len ? len : max_len;
    }
    if (lo >= hi) return;
    float *scores = malloc(sizeof(float) * (size_t)(max_len > 0 ? max_len : 1) * (size_t)(a->heads / a->kv_heads));
    if (!scores) {
        atomic_store(&((decode_args_t *)ctx)->failed, 1);
        return;
    }
    for (int64_t i = lo; i < hi; i++) decode_one(a, i / a->kv_heads, i % a->kv_heads, scores);
    free(scores);
}

/* Store each sequence's new key and value at its slot (slot < 0: a padding row, stored nowhere), then
 * attend its one query token over its whole context. head_dim must be a multiple of 32. */
int paged_decode_bf16(void *pool, const omp_team_t *team, const bf16_t *q, const bf16_t *k, const bf16_t *v, int64_t q_stride,
                       int64_t k_stride, int64_t v_stride, bf16_t *cache, int64_t num_blocks, int64_t block_size,
                       const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                       const int64_t *slots, bf16_t *out, int64_t seqs, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, float scale, float soft_cap, int64_t window, int nthreads) {
    const int64_t token_stride = kv_heads * head_dim;
    bf16_t *vcache = cache + num_blocks * block_size * token_stride;
    for (int64_t s = 0; s < seqs; s++) {
        if (slots[s] < 0) continue;
        for (int64_t g = 0; g < kv_heads; g++) {
            memcpy(cache + slots[s] * token_stride + g * head_dim, k + s * k_stride + g * head_dim, 2 * head_dim);
            memcpy(vcache + slots[s] * token_stride + g * head_dim, v + s * v_stride + g * head_dim, 2 * head_dim);
        }
    }
    decode_args_t a = {q, k, v, q_stride, cache, num_blocks, block_size, block_tables, table_stride,
                       seq_lens, slots, out, seqs, heads, kv_heads, head_dim, scale, soft_cap, window, 0};
    team_run(team, pool, decode_task, &a, nthreads);
    return atomic_load(&a.failed) ? -1 : 0;
}
