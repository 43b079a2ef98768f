/* The shm engine's protocol with ranks as threads, for ThreadSanitizer (tests/test_shm_native.py,
 * .ci/native.sh): one segment laid out as cpuddp/backends/shm/protocol/check.py lays it out, N threads each
 * with its own context and liveness lock, ITERS rounds of every collective engine.c runs, each
 * result checked, then all_reduces queued on each rank's progress thread, and the thread
 * stopped.  Built together with engine.c (included), so the sanitizer sees its every access:
 *   cc -fsanitize=thread -O1 -g -pthread -I cpuddp/backends/shm/native threads.c
 * Usage: threads RANKS ITERS; prints "ok" and exits 0, or names the first wrong value. */

#include "engine.c"

#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>

#define SLOT 8192
#define PAGE 4096
#define ROUND_UP(x) (((x) + PAGE - 1) / PAGE * PAGE)

static int N, ITERS, FD;
static char *BASE;
/* every rank holds its liveness lock before any waits: a rank that waited on a peer whose thread
 * had not started yet (a loaded machine) would find it "dead", as the engine's hand-over rules out */
static pthread_barrier_t STARTED;
static int64_t COUNTERS_AT = PAGE, RING_AT, SLOTS_AT, TOTAL;

static void entry(entry_t *e, int kind, int dtype, int op, int root, int64_t numel, int64_t m) {
    memset(e, 0, sizeof *e);
    int64_t d[7] = {kind, op, dtype, numel, root, 1, -1};
    memcpy(e->desc, d, sizeof d);
    e->kind = kind, e->dtype = dtype, e->op = op, e->root = root, e->numel = numel, e->m = m;
}

static int run(ctx_t *c, entry_t *e, void *a, void *b) {
    int rc = cpuddp_shm_call(c, e, a, b);
    while (rc == RC_AGAIN) rc = cpuddp_shm_resume(c);
    return rc;
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
    float *f = malloc(sizeof(float) * 20000);
    int32_t *ints = malloc(sizeof(int32_t) * 20000 * N);
    int32_t *gathered = malloc(sizeof(int32_t) * 3000 * N);
    entry_t e;
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
        for (int64_t j = 0; j < m; j++) f[j] = me == root ? (float)j : -1.0f;
        entry(&e, K_BROADCAST, -1, 0, root, m * 4, m * 4);
        if (run(c, &e, f, 0)) goto failed;
        for (int64_t j = 0; j < m; j++)
            if (f[j] != (float)j) {
                fprintf(stderr, "rank %d iter %d: broadcast[%lld] = %g\n", me, it, (long long)j, f[j]);
                exit(1);
            }
        int64_t k = it % 3000 + 1;
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
    if (pthread_barrier_init(&STARTED, 0, (unsigned)N)) return 2;
    for (int r = 0; r < N; r++) pthread_create(&th[r], 0, rank_main, (void *)(intptr_t)r);
    for (int r = 0; r < N; r++) pthread_join(th[r], 0);
    printf("ok: %d ranks, %d iterations\n", N, ITERS);
    return 0;
}
