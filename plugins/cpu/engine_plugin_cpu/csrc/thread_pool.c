/* The kernels' thread pool: a task runs on the caller's thread and the pool's workers. Workers spin
 * briefly between tasks (a decode step issues one every few microseconds), then sleep on a condvar. */
#include <time.h>
#include <unistd.h>

#include "common.h"

/* how long a worker spins before sleeping, in nanoseconds: a decode step's Python between two products takes up
 * to about 100 us of a small model's layer, and a worker asleep costs a futex wake-up a task (4,000 pauses, 39 us
 * on a 2-core Xeon of 2026, gave 93 / 158 / 262 tok/s of 1 / 2 / 4 sequences against 104-115 / 176-192 / 270-287 for
 * 20,000 under OMP_WAIT_POLICY=passive); the clock is read every SPIN_CHECK pauses (a pause's length varies by
 * CPU from about 10 to 140 cycles) */
#define SPIN_NS 200000
#define SPIN_CHECK 64
#define MAX_WORKERS 63

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint generation;
    atomic_int pending;
    atomic_int sleeping;
    atomic_int stop;
    task_fn fn;
    void *ctx;
    int nthreads;
    int nworkers;
    pid_t owner; /* a forked child has none of the workers: it runs tasks serially */
    pthread_t threads[MAX_WORKERS];
} pool_t;

typedef struct {
    pool_t *pool;
    int tid;
} worker_arg_t;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *worker_main(void *raw) {
    worker_arg_t arg = *(worker_arg_t *)raw;
    free(raw);
    pool_t *p = arg.pool;
    unsigned seen = 0;
    for (;;) {
        unsigned gen;
        int spins = 0;
        int64_t spin_from = now_ns();
        while ((gen = atomic_load(&p->generation)) == seen) {
            if (atomic_load(&p->stop)) return NULL;
            if (++spins % SPIN_CHECK != 0 || now_ns() - spin_from < SPIN_NS) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleeping, 1);
            while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleeping, 1);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
        }
        seen = gen;
        if (arg.tid < p->nthreads) p->fn(p->ctx, arg.tid, p->nthreads);
        atomic_fetch_sub(&p->pending, 1);
    }
}

/* A pool with nthreads - 1 workers (the caller is thread 0); NULL on failure. */
void *pool_create(int nthreads) {
    pool_t *p = calloc(1, sizeof(pool_t));
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->owner = getpid();
    int want = nthreads - 1;
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    for (int i = 0; i < want; i++) {
        worker_arg_t *arg = malloc(sizeof(worker_arg_t));
        if (!arg) break;
        arg->pool = p;
        arg->tid = i + 1;
        if (pthread_create(&p->threads[i], NULL, worker_main, arg) != 0) {
            free(arg);
            break;
        }
        p->nworkers++;
    }
    return p;
}

void pool_destroy(void *raw) {
    pool_t *p = raw;
    if (!p) return;
    if (getpid() != p->owner) return; /* the workers belong to the parent process */
    atomic_store(&p->stop, 1);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nworkers; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

int pool_size(void *raw) { return raw ? ((pool_t *)raw)->nworkers + 1 : 1; }

void pool_run(void *raw, task_fn fn, void *ctx, int nthreads) {
    pool_t *p = raw;
    if (!p || p->nworkers == 0 || nthreads <= 1 || getpid() != p->owner) {
        fn(ctx, 0, 1);
        return;
    }
    if (nthreads > p->nworkers + 1) nthreads = p->nworkers + 1;
    p->fn = fn;
    p->ctx = ctx;
    p->nthreads = nthreads;
    atomic_store(&p->pending, p->nworkers);
    atomic_fetch_add(&p->generation, 1);
    if (atomic_load(&p->sleeping)) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    fn(ctx, 0, nthreads);
    while (atomic_load(&p->pending) > 0) _mm_pause();
}

typedef struct {
    const omp_team_t *team;
    task_fn fn;
    void *ctx;
} team_task_t;

static void team_trampoline(void *raw) {
    team_task_t *t = raw;
    t->fn(t->ctx, t->team->thread_num(), t->team->num_threads());
}

void team_run(const omp_team_t *team, void *pool, task_fn fn, void *ctx, int nthreads) {
    /* a forked child takes the pool's serial path: GNU OpenMP's team would wait for the parent's workers */
    if (!team || nthreads <= 1 || (pool && ((pool_t *)pool)->owner != getpid())) {
        pool_run(pool, fn, ctx, nthreads);
        return;
    }
    team_task_t t = {team, fn, ctx};
    team->parallel(team_trampoline, &t, (unsigned)nthreads, 0);
}
