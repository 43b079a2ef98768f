/* The shm engine's protocol with ranks as threads, for ThreadSanitizer (tests/test_shm_native.py,
 * .ci/native.sh): one segment laid out as cpuddp/backends/shm/protocol/check.py lays it out, by
 * layout.h's numbers; N threads each with its own context and liveness lock; ITERS rounds of
 * every collective engine.c runs, each result checked (64 KiB slots: all_reduces of one and of
 * two rounds per chunk, several chunks); then a call resumed after AGAIN whose later wait must
 * start its own clock, all_reduces queued on each rank's progress thread, the thread stopped,
 * and a call in the caller's thread after that.  Each rank first has a call refused (an op its
 * dtype has no kernel for), which must leave the context usable.  Built together with engine.c
 * (included), so the sanitizer sees its every access:
 *   cc -fsanitize=thread -O1 -g -pthread -I cpuddp/backends/shm/native threads.c
 * Usage: threads RANKS ITERS; prints "ok" and exits 0, or names the first wrong value. */

#include "engine.c"

#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>

#define SLOT 65536 /* PAGE, LINE, RING, DESC and the structs: layout.h's, through engine.c */
#define ROUND_UP(x) (((x) + PAGE - 1) / PAGE * PAGE)

static int N, ITERS, FD;
static char *BASE;
/* every rank holds its liveness lock before any waits: a rank that waited on a peer whose thread
 * had not started yet (a loaded machine) would find it "dead", as the engine's hand-over rules out */
static pthread_barrier_t STARTED, PHASE;
static int64_t COUNTERS_AT = PAGE, RING_AT, SLOTS_AT, TOTAL;

static void entry(entry_t *e, int kind, int dtype, int op, int root, int64_t numel, int64_t m) {
    memset(e, 0, sizeof *e);
    int64_t d[DESC_WORDS] = {kind, op, dtype, numel, root, 1, -1};
    memcpy(e->desc, d, sizeof d);
    e->kind = kind, e->dtype = dtype, e->op = op, e->root = root, e->numel = numel, e->m = m;
}

static int run(ctx_t *c, entry_t *e, void *a, void *b) {
    int rc = cpuddp_shm_call(c, e, a, b);
    while (rc == RC_AGAIN) rc = cpuddp_shm_resume(c);
    return rc;
}

static void nap_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts)) {}
}

static void failed(int me, const char *what, int rc, const state_t *st) {
    fprintf(stderr, "rank %d: %s: rc %d (peer %lld, where %lld, value %lld)\n", me, what, rc, (long long)st->err_peer,
            (long long)st->err_where, (long long)st->err_value);
    exit(1);
}

/* A wait resumed after AGAIN that finds its peers there at once has ended: the call's next wait
 * starts its own clock.  Rank 0 waits in round 1 until its call returns AGAIN and stays away
 * 700 ms (its peers arrive meanwhile and wait for it in the next round, until AGAIN, then stay
 * away 1 s); back, it waits ~0.4 s for them in a later round: inside a timeout of 0.6 s counted
 * from that wait's start, past it counted from round 1's. */
static void resumed_clock(ctx_t *c, state_t *st, int me, float *f) {
    enum { M = 2 * (SLOT / 4) }; /* two chunks */
    entry_t e;
    entry(&e, K_ALL_REDUCE, DT_F32, OPC_SUM, 0, M, M);
    for (int64_t j = 0; j < M; j++) f[j] = (float)(me + j % 7);
    int64_t timeout = c->timeout_ns;
    c->timeout_ns = (int64_t)600 * 1000000;
    pthread_barrier_wait(&PHASE);
    if (me) nap_ms(100);
    int rc = cpuddp_shm_call(c, &e, f, 0);
    if (rc == RC_AGAIN) nap_ms(me ? 1000 : 700);
    while (rc == RC_AGAIN) rc = cpuddp_shm_resume(c);
    if (rc) failed(me, "the resumed all_reduce", rc, st);
    c->timeout_ns = timeout;
    for (int64_t j = 0; j < M; j++) {
        float want = 0;
        for (int r = 0; r < N; r++) want += (float)(r + j % 7);
        if (f[j] != want) {
            fprintf(stderr, "rank %d: resumed all_reduce[%lld] = %g, want %g\n", me, (long long)j, f[j], want);
            exit(1);
        }
    }
}

static void *rank_main(void *arg) {
    int me = (int)(intptr_t)arg;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", FD);
    int lock_fd = open(path, O_RDWR | O_CLOEXEC);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = TOTAL + me, .l_len = 1};
    if (lock_fd < 0 || fcntl(lock_fd, F_OFD_SETLK, &fl)) {
        perror("liveness lock");
        exit(2);
    }
    pthread_barrier_wait(&STARTED);
    state_t st = {0};
    ctx_t *c = calloc(1, sizeof *c);
    int pidfds[MAX_RANKS];
    for (int r = 0; r < N; r++) pidfds[r] = -1;
    if (cpuddp_shm_init(c, &st, BASE, COUNTERS_AT, RING_AT, SLOTS_AT, SLOT, TOTAL, N, me, FD, pidfds, me % 2,
                        cpuddp_shm_best_isa(), (int64_t)60 * 1000000000)) {
        fprintf(stderr, "init refused\n");
        exit(2);
    }
    float *f = malloc(sizeof(float) * 40000);
    int32_t *ints = malloc(sizeof(int32_t) * 20000 * N);
    int32_t *gathered = malloc(sizeof(int32_t) * 20000 * N);
    entry_t e;
    /* a call prepare() refuses (no kernel for a bitwise op on floats): refused, the context still usable */
    entry(&e, K_ALL_REDUCE, DT_F32, OPC_BAND, 0, 4, 4);
    int refused = cpuddp_shm_call(c, &e, f, 0);
    if (refused != RC_ARG) failed(me, "a bitwise all_reduce of float32 was not refused", refused, &st);
    for (int it = 0; it < ITERS; it++) {
        int64_t m = (it * 997) % 20000 + 1;
        for (int64_t j = 0; j < m; j++) f[j] = (float)(me + j % 5);
        entry(&e, K_ALL_REDUCE, DT_F32, OPC_SUM, 0, m, m);
        if (run(c, &e, f, 0)) goto failed;
        for (int64_t j = 0; j < m; j++) {
            float want = 0;
            for (int r = 0; r < N; r++) want += (float)(r + j % 5);
            if (f[j] != want) {
                fprintf(stderr, "rank %d iter %d: all_reduce[%lld] = %g, want %g\n", me, it, (long long)j, f[j], want);
                exit(1);
            }
        }
        int root = it % N;
        for (int64_t j = 0; j < m; j++) f[j] = (float)(me * 3 + j % 5);
        entry(&e, K_REDUCE, DT_F32, OPC_SUM, root, m, m);
        if (run(c, &e, f, 0)) goto failed;
        for (int64_t j = 0; j < m; j++) {
            float want = (float)(me * 3 + j % 5); /* a rank not the root keeps its input */
            if (me == root) {
                want = 0;
                for (int r = 0; r < N; r++) want += (float)(r * 3 + j % 5);
            }
            if (f[j] != want) {
                fprintf(stderr, "rank %d iter %d: reduce to %d [%lld] = %g, want %g\n", me, it, root, (long long)j, f[j],
                        want);
                exit(1);
            }
        }
        for (int64_t j = 0; j < m; j++) f[j] = me == root ? (float)j : -1.0f;
        entry(&e, K_BROADCAST, -1, 0, root, m * 4, m * 4);
        if (run(c, &e, f, 0)) goto failed;
        for (int64_t j = 0; j < m; j++)
            if (f[j] != (float)j) {
                fprintf(stderr, "rank %d iter %d: broadcast[%lld] = %g\n", me, it, (long long)j, f[j]);
                exit(1);
            }
        int64_t k = (it * 331) % 20000 + 1;
        int32_t *mine = gathered + me * k;
        for (int64_t j = 0; j < k; j++) mine[j] = me * 100000 + (int32_t)j;
        entry(&e, K_ALL_GATHER, -1, 0, 0, k * 4, k * 4);
        if (run(c, &e, gathered, mine)) goto failed;
        for (int r = 0; r < N; r++)
            for (int64_t j = 0; j < k; j++)
                if (gathered[r * k + j] != r * 100000 + (int32_t)j) {
                    fprintf(stderr, "rank %d iter %d: all_gather row %d[%lld] wrong\n", me, it, r, (long long)j);
                    exit(1);
                }
        int64_t part = it % 5000 + 1;
        int32_t out[5000];
        for (int64_t j = 0; j < part * N; j++) ints[j] = (int32_t)(j + me);
        entry(&e, K_REDUCE_SCATTER, DT_I32, OPC_SUM, 0, part, part);
        if (run(c, &e, out, ints)) goto failed;
        for (int64_t j = 0; j < part; j++) {
            int32_t want = 0;
            for (int r = 0; r < N; r++) want += (int32_t)(me * part + j + r);
            if (out[j] != want) {
                fprintf(stderr, "rank %d iter %d: reduce_scatter[%lld] = %d, want %d\n", me, it, (long long)j, out[j], want);
                exit(1);
            }
        }
        entry(&e, K_BARRIER, -1, 0, 0, 0, 0);
        if (run(c, &e, 0, 0)) goto failed;
    }
    resumed_clock(c, &st, me, f);
    /* the progress thread: QUEUED all_reduces submitted at once, their results taken in order,
     * then the thread stopped (its queue, the submit/stop lock and the result hand-over) */
    enum { QUEUED = 8, LEN = 3000 };
    float *bufs = malloc(sizeof(float) * QUEUED * LEN);
    int64_t err[3];
    if (cpuddp_shm_start(c)) goto failed;
    for (int it = 0; it < ITERS / 10 + 1; it++) {
        entry(&e, K_ALL_REDUCE, DT_F32, OPC_SUM, 0, LEN, LEN);
        int64_t first = -1;
        for (int q = 0; q < QUEUED; q++) {
            for (int j = 0; j < LEN; j++) bufs[q * LEN + j] = (float)(me + q + j % 3);
            int64_t t = cpuddp_shm_submit(c, &e, bufs + q * LEN, 0);
            if (t < 0) goto failed;
            if (first < 0) first = t;
        }
        for (int q = 0; q < QUEUED; q++) {
            int rc;
            while ((rc = cpuddp_shm_wait(c, first + q, 50000000, err)) == RC_AGAIN) {}
            if (rc) goto failed;
            for (int j = 0; j < LEN; j++) {
                float want = 0;
                for (int r = 0; r < N; r++) want += (float)(r + q + j % 3);
                if (bufs[q * LEN + j] != want) {
                    fprintf(stderr, "rank %d: queued all_reduce %d [%d] = %g, want %g\n", me, q, j, bufs[q * LEN + j], want);
                    exit(1);
                }
            }
        }
    }
    cpuddp_shm_stop(c);
    /* after the thread stopped, a call in the caller's thread still waits for its peers */
    pthread_barrier_wait(&PHASE);
    if (me == N - 1) nap_ms(50);
    entry(&e, K_BARRIER, -1, 0, 0, 0, 0);
    int rc = run(c, &e, 0, 0);
    if (rc) failed(me, "a barrier after the progress thread stopped", rc, &st);
    free(bufs), free(f), free(ints), free(gathered), free(c);
    return 0;
failed:
    fprintf(stderr, "rank %d: a call failed (peer %lld, where %lld, value %lld)\n", me, (long long)st.err_peer,
            (long long)st.err_where, (long long)st.err_value);
    exit(1);
}

int main(int argc, char **argv) {
    N = argc > 1 ? atoi(argv[1]) : 4;
    ITERS = argc > 2 ? atoi(argv[2]) : 100;
    if (N < 2 || N > 64) return 2;
    RING_AT = PAGE + ROUND_UP(LINE * N);
    SLOTS_AT = RING_AT + ROUND_UP(RING * DESC * N);
    TOTAL = SLOTS_AT + 2 * (int64_t)N * SLOT;
    FD = memfd_create("cpuddp-threads", MFD_CLOEXEC);
    if (FD < 0 || ftruncate(FD, TOTAL)) return 2;
    BASE = mmap(0, TOTAL, PROT_READ | PROT_WRITE, MAP_SHARED, FD, 0);
    if (BASE == MAP_FAILED) return 2;
    pthread_t th[64];
    if (pthread_barrier_init(&STARTED, 0, (unsigned)N) || pthread_barrier_init(&PHASE, 0, (unsigned)N)) return 2;
    for (int r = 0; r < N; r++) pthread_create(&th[r], 0, rank_main, (void *)(intptr_t)r);
    for (int r = 0; r < N; r++) pthread_join(th[r], 0);
    printf("ok: %d ranks, %d iterations\n", N, ITERS);
    return 0;
}
