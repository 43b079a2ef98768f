/* cpuddp shm native engine: the data path of the node-local collectives, in plain C.
 *
 * It runs the same protocol over the same segment as the Python engine
 * (cpuddp/backends/shm/python/local.py, channel.py, descriptor.py): one collective is one call here, which
 * posts the call's descriptor, moves the data in rounds and compares the descriptors, and a
 * group may run some calls here and others in Python (every rank of a node takes the same path
 * for a call: the choice is made from what the ranks agreed).  No Python or torch headers; the
 * binding is cpuddp/backends/shm/native/__init__.py (ctypes, which releases the GIL for the
 * call), which checks every argument before it reaches this file.
 *
 * Memory ordering.  A rank publishes by a release store of a counter after the writes it
 * publishes (its descriptor, then `posted`; its slot's data, then `arrived`; its reads done,
 * then `checked`), and reads a peer's entry or slot only after an acquire load of that peer's
 * counter showed the value.  A slot of parity p is written again only two rounds later, after
 * every peer arrived at the round between (which each does only after its reads); a ring entry
 * only after every peer's `checked` passed the call that used it.  The Python engine keeps the
 * same order for what it runs beside this file (the collectives this file does not run, the
 * agreement of the path when a group forms): on x86 its plain stores and loads are release
 * stores and acquire loads (TSO); on any other CPU (aarch64) it calls cpuddp_shm_fence, a full
 * fence, after each counter it waited for and before each counter it raises
 * (cpuddp/backends/shm/protocol/channel.py).  There a group forms only on this path, agreed by
 * every local rank: without this library Python has no fence (group/arch.py refuses it).  This
 * file's protocol tests run on aarch64 under qemu (tests/native/threads.c, .ci/native.sh).
 *
 * Waiting: the wait policy of layout.h (pause, sched_yield, then the segment's futex; the
 * late peers looked at every WAIT_CHECK_NS; RC_AGAIN every WAIT_SLICE_NS, so the caller's
 * thread runs Python's signal handlers and the call resumes where it stopped).
 *
 * The segment's layout, this library's interface (results, collectives, the structs its binding
 * shares) and the wait's numbers are layout.h's, which Python reads too: defined there once.
 *
 * Bounds: every offset and length comes from the context the binding set up (from the
 * segment's checked layout), the call's own arguments, or arithmetic on them; nothing is read
 * from a segment word but counters, states and descriptors, which are only compared.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "layout.h"

/* dtypes (cpuddp.backends.shm.protocol.descriptor's codes) */
enum { DT_F32 = 0, DT_F64 = 1, DT_F16 = 2, DT_BF16 = 3, DT_I8 = 4, DT_U8 = 5, DT_I16 = 6, DT_I32 = 7, DT_I64 = 8 };
/* reduce ops (torch's ReduceOp codes) */
enum { OPC_SUM = 0, OPC_AVG = 1, OPC_PROD = 2, OPC_MIN = 3, OPC_MAX = 4, OPC_BAND = 5, OPC_BOR = 6, OPC_BXOR = 7 };
#define MAX_RANKS 256      /* local ranks a context takes */
#define SMALL 32768        /* all_reduce chunks up to this many bytes: one round, every rank sums all rows */
#define QUEUE 64           /* calls the progress thread may hold */
#define QUEUE_SPIN_NS 20000 /* ns the progress thread polls for the next call before it sleeps */

typedef void (*rows_fn)(void *out, const void *const *rows, int k, int64_t m);

/* ---------------------------------------------------------------- 16-bit floats, as c10 does */

static inline float f32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t bits = sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
    return f32_from_bits(bits);
}

static inline uint16_t f32_to_f16(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    if (f != f) return (uint16_t)((u >> 16) | 0x0040u); /* a quiet NaN, its sign kept */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* ---------------------------------------------------------------- kernels, one set per width */

/* Each x86 width's kernels are compiled for that width inside a target region: GCC's `#pragma
 * GCC target`, clang's `#pragma clang attribute` (clang ignores GCC's pragma, and zig cc is
 * clang).  A compiler with neither compiles no vector width: VEC_COMPILED is 0, the library says
 * so (cpuddp_shm_isa_compiled) and runs its scalar kernels at every width. */
#define KSUFFIX scalar
#include "kernels.h"
#undef KSUFFIX

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__clang__) || defined(__GNUC__))
#define VEC_COMPILED 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif
#define KSUFFIX avx2
#include "kernels.h"
#undef KSUFFIX
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
#endif
#define KSUFFIX avx512
#include "kernels.h"
#undef KSUFFIX
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
#define VEC_COMPILED 0
#endif

/* ---------------------------------------------------------------- the context */

/* state_t (a context's counters, the binding's) and entry_t (a prepared call): layout.h's */

typedef struct {
    int kind, dtype, op, root, step, two; /* two: this chunk has a second round */
    char *a, *b;                          /* the tensors (bytes) */
    int64_t numel, esize, m;              /* elements of a (and of the output's part), bytes each */
    int64_t o, k, e;                      /* this chunk: offset, elements, first round */
    int64_t wait_start, call_start;       /* ns */
    int64_t slice_ns;                     /* return AGAIN after waiting this long in one call (0: never) */
    int queued;                           /* run by the progress thread: a stop ends its waits */
    rows_fn fn;
    int64_t desc[DESC_WORDS];
} op_t;

/* one queued call: its arguments, then its result (done is the futex word its waiter sleeps on) */
typedef struct {
    entry_t en;
    void *a, *b;
    int64_t ticket;
    int64_t err[3]; /* err_peer, err_where, err_value */
    int32_t rc;
    uint32_t done;
} job_t;

/* the progress thread's queue: tickets count up; job t lives in jobs[t % QUEUE] */
typedef struct {
    pthread_t thread;
    pthread_mutex_t lock; /* a submit's check of `closing` and its publish of `tail` are one step
                           * for cpuddp_shm_stop: every call queued is run or given RC_CLOSED */
    int started;
    int32_t closing;
    int64_t head;  /* the next ticket the thread runs */
    int64_t tail;  /* the next ticket a caller gets */
    int64_t taken; /* results read up to here (in order): a job's place is reused only after */
    uint32_t bell; /* futex: rung when tail rises or the queue closes */
    job_t jobs[QUEUE];
} queue_t;

typedef struct {
    state_t *st;
    volatile char *base; /* the segment's mapping */
    int64_t counters_at, ring_at, slots_at, slot, total;
    int n, me, fd, spin, isa, pad;
    int64_t timeout_ns;
    int pidfd[MAX_RANKS];
    op_t op;
    queue_t q;
} ctx_t;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t *line_word(ctx_t *c, int r, int w) {
    return (int64_t *)(c->base + c->counters_at + (int64_t)r * LINE) + w;
}
static inline int64_t *ring_entry(ctx_t *c, int64_t seq, int r) {
    return (int64_t *)(c->base + c->ring_at + ((seq % RING) * c->n + r) * DESC);
}
static inline char *slot_of(ctx_t *c, int64_t e, int r) {
    return (char *)(c->base + c->slots_at + ((e & 1) * c->n + r) * c->slot);
}
static inline uint32_t *bell(ctx_t *c) { return (uint32_t *)(c->base + BELL_AT); }
static inline int32_t *sleepers(ctx_t *c) { return (int32_t *)(c->base + SLEEPERS_AT); }

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

/* after raising a counter: wake the waiters that said they sleep (one fence and a load when none) */
static void ring_bell(ctx_t *c) {
#if defined(__SANITIZE_THREAD__) /* ThreadSanitizer models no fences: the same order as an RMW */
    if (__atomic_fetch_add(sleepers(c), 0, __ATOMIC_SEQ_CST) > 0) {
#else /* the counter's store, then this load: a full fence between (the sleeper's side: its RMW) */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers(c), __ATOMIC_RELAXED) > 0) {
#endif
        __atomic_fetch_add(bell(c), 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, bell(c), FUTEX_WAKE, INT_MAX, NULL, NULL, 0); /* shared: no PRIVATE flag */
    }
}

static void raise_word(ctx_t *c, int w, int64_t v) {
    STORE(line_word(c, c->me, w), v);
    ring_bell(c);
}

/* the first local rank (not this one when skip_me) whose word w is below v, or -1 */
static int late_rank(ctx_t *c, int w, int64_t v, int skip_me) {
    for (int r = 0; r < c->n; r++) {
        if (skip_me && r == c->me) continue;
        if (LOAD(line_word(c, r, w)) < v) return r;
    }
    return -1;
}

/* does local rank r's process still hold its liveness lock (and its pidfd not signal exit)? */
static int peer_alive(ctx_t *c, int r) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = c->total + r;
    fl.l_len = 1;
    if (fcntl(c->fd, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK) return 0;
    if (c->pidfd[r] >= 0) {
        struct pollfd p = {c->pidfd[r], POLLIN, 0};
        if (poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP))) return 0;
    }
    return 1;
}

static int compare(ctx_t *c, int64_t seq);

/* while waiting: a peer's differing descriptor is an error now, not at the timeout */
static int early_compare(ctx_t *c) {
    int64_t seq = c->st->unchecked;
    if (seq && late_rank(c, C_POSTED, seq, 0) < 0) return compare(c, seq);
    return RC_OK;
}

static int fail(ctx_t *c, int rc, int peer, int where, int64_t value) {
    c->st->err_peer = peer;
    c->st->err_where = where;
    c->st->err_value = value;
    return rc;
}

/* a wait ended: the call's next wait starts its own clock (also when a wait resumed after AGAIN
 * finds every peer there at once) */
static inline int done_waiting(op_t *op) {
    op->wait_start = 0;
    return RC_OK;
}

/* wait until every local rank's word w (but this rank's when skip_me) is at least v */
static int wait_words(ctx_t *c, int w, int64_t v, int skip_me, int where) {
    op_t *op = &c->op;
    if (late_rank(c, w, v, skip_me) < 0) return done_waiting(op);
    int64_t start = now_ns(), now = start;
    while (now - start < WAIT_SPIN_NS) {
        for (int i = 0; i < 16; i++) cpu_relax();
        if (late_rank(c, w, v, skip_me) < 0) return done_waiting(op);
        now = now_ns();
    }
    if (!op->wait_start) op->wait_start = start;
    int64_t check_at = now + WAIT_CHECK_NS;
    for (;;) {
        int late = late_rank(c, w, v, skip_me);
        if (late < 0) return done_waiting(op);
        if (op->queued && __atomic_load_n(&c->q.closing, __ATOMIC_ACQUIRE)) return fail(c, RC_CLOSED, late, where, v);
        int64_t aborted = LOAD((int64_t *)c->base + W_ABORT);
        if (aborted) {
            int rc = early_compare(c); /* a mismatch a peer found is this rank's error too */
            return rc ? rc : fail(c, RC_ABORT, (int)(aborted - 1), where, v);
        }
        now = now_ns();
        if (now >= check_at) {
            check_at = now + WAIT_CHECK_NS;
            int rc = early_compare(c);
            if (rc) return rc;
            for (int r = 0; r < c->n; r++) {
                if (r == c->me || LOAD(line_word(c, r, w)) >= v) continue;
                if (LOAD(line_word(c, r, C_STATE)) == STATE_LEFT) return fail(c, RC_LEFT, r, where, v);
                if (!peer_alive(c, r)) return fail(c, RC_DEAD, r, where, v);
            }
            if (now - op->wait_start > c->timeout_ns) return fail(c, RC_TIMEOUT, late, where, v);
        }
        if (op->slice_ns && now - op->call_start > op->slice_ns) return RC_AGAIN;
        int64_t waited = now - op->wait_start;
        if (waited < (c->spin ? WAIT_YIELD_NS : WAIT_YIELD_SHARED_NS)) {
            sched_yield();
            continue;
        }
        int64_t nap = waited / WAIT_SLEEP_SHARE;
        nap = nap < WAIT_SLEEP_MIN_NS ? WAIT_SLEEP_MIN_NS : nap > WAIT_SLEEP_MAX_NS ? WAIT_SLEEP_MAX_NS : nap;
        __atomic_fetch_add(sleepers(c), 1, __ATOMIC_SEQ_CST);
        uint32_t rung = __atomic_load_n(bell(c), __ATOMIC_SEQ_CST);
        if (late_rank(c, w, v, skip_me) >= 0) {
            struct timespec ts = {nap / 1000000000, nap % 1000000000};
            syscall(SYS_futex, bell(c), FUTEX_WAIT, rung, &ts, NULL, 0);
        }
        __atomic_fetch_sub(sleepers(c), 1, __ATOMIC_SEQ_CST);
    }
}

/* ---------------------------------------------------------------- the agreement */

static int post(ctx_t *c) {
    int64_t seq = c->st->seq + 1;
    if (c->n > 1) {
        int rc = wait_words(c, C_CHECKED, seq - RING, 1, AT_POST);
        if (rc) return rc;
    }
    int64_t *entry = ring_entry(c, seq, c->me);
    for (int i = 0; i < DESC_WORDS; i++) __atomic_store_n(&entry[1 + i], c->op.desc[i], __ATOMIC_RELAXED);
    STORE(&entry[0], seq);
    c->st->seq = seq;
    c->st->unchecked = seq;
    c->st->calls++;
    raise_word(c, C_POSTED, seq);
    return RC_OK;
}

/* every rank posted call seq: are their descriptors this rank's? */
static int compare(ctx_t *c, int64_t seq) {
    const int64_t *mine = ring_entry(c, seq, c->me);
    for (int r = 0; r < c->n; r++) {
        if (r == c->me) continue;
        const int64_t *theirs = ring_entry(c, seq, r);
        for (int i = 0; i < 1 + DESC_WORDS; i++)
            if (LOAD(&theirs[i]) != mine[i]) return fail(c, RC_MISMATCH, r, AT_SETTLE, seq);
    }
    c->st->unchecked = 0;
    raise_word(c, C_CHECKED, seq);
    return RC_OK;
}

static int settle(ctx_t *c) {
    int64_t seq = c->st->unchecked;
    if (!seq) return RC_OK;
    int rc = wait_words(c, C_POSTED, seq, 0, AT_SETTLE);
    return rc ? rc : compare(c, seq);
}

/* announce arrival at round e (after this rank's writes for it) */
static void arrive(ctx_t *c, int64_t e) { raise_word(c, C_ARRIVED, e); }

/* every rank arrived at round e: the call is compared, no rank gave up */
static int round_wait(ctx_t *c, int64_t e) {
    int rc = wait_words(c, C_ARRIVED, e, 0, AT_ROUND);
    if (rc) return rc;
    if ((rc = settle(c))) return rc;
    int64_t aborted = LOAD((int64_t *)c->base + W_ABORT);
    if (aborted) return fail(c, RC_ABORT, (int)(aborted - 1), AT_ROUND, e);
    c->st->epoch = e;
    return RC_OK;
}

/* ---------------------------------------------------------------- the collectives */

static int64_t part_length(int64_t k, int n, int64_t size) {
    int64_t align = ALIGN / size > 1 ? ALIGN / size : 1;
    int64_t per = (k + n - 1) / n;
    int64_t p = (per + align - 1) / align * align;
    return p > align ? p : align;
}

static void span(int64_t p, int64_t k, int i, int64_t *lo, int64_t *hi) {
    int64_t l = (int64_t)i * p;
    if (l > k) l = k;
    *lo = l;
    *hi = l + p < k ? l + p : k;
}

/* elements of esize bytes per slot region when a slot holds `parts` regions (64-byte aligned) */
static int64_t cap_of(ctx_t *c, int64_t esize, int parts) {
    int64_t per = (c->slot / parts) / ALIGN * ALIGN / esize;
    return per > 0 ? per : 1;
}

/* the kernel's element count and rows for m elements (bitwise ops run on bytes) */
static void reduce_rows(ctx_t *c, void *out, const void *const *rows, int k, int64_t m) {
    op_t *op = &c->op;
    int64_t units = (op->op == OPC_BAND || op->op == OPC_BOR || op->op == OPC_BXOR) ? m * op->esize : m;
    op->fn(out, rows, k, units);
}

enum { S_POST = 0, S_CHUNK, S_ROUND1, S_ROUND2, S_NEXT, S_SETTLE };

/* a chunk's first half: what this rank writes before it arrives at round e; whether the chunk
 * has a second round */
static int chunk_in(ctx_t *c) {
    op_t *op = &c->op;
    int n = c->n, me = c->me;
    int64_t es = op->esize, e = op->e;
    char *mine = slot_of(c, e, me);
    switch (op->kind) {
    case K_ALL_REDUCE: {
        int64_t cap = cap_of(c, es, 1);
        op->k = op->numel - op->o < cap ? op->numel - op->o : cap;
        memcpy(mine, op->a + op->o * es, (size_t)(op->k * es));
        return n > 2 && op->k * es > SMALL;
    }
    case K_REDUCE: {
        int64_t cap = cap_of(c, es, 1);
        op->k = op->numel - op->o < cap ? op->numel - op->o : cap;
        if (me != op->root) memcpy(mine, op->a + op->o * es, (size_t)(op->k * es));
        return 0;
    }
    case K_BROADCAST: {
        int64_t cap = cap_of(c, 1, 1);
        op->k = op->numel - op->o < cap ? op->numel - op->o : cap;
        if (me == op->root) memcpy(mine, op->a + op->o, (size_t)op->k);
        return 0;
    }
    case K_ALL_GATHER: {
        int64_t cap = cap_of(c, 1, 1);
        op->k = op->numel - op->o < cap ? op->numel - op->o : cap;
        memcpy(mine, op->b + op->o, (size_t)op->k);
        return 0;
    }
    case K_REDUCE_SCATTER: {
        int64_t cap = cap_of(c, es, n);
        op->k = op->m - op->o < cap ? op->m - op->o : cap;
        for (int r = 0; r < n; r++)
            if (r != me) memcpy(mine + r * cap * es, op->b + (r * op->m + op->o) * es, (size_t)(op->k * es));
        return 0;
    }
    }
    return 0;
}

/* after round e: reduce or copy out; with a second round, this rank's part into its slot of
 * the other buffer */
static void chunk_mid(ctx_t *c) {
    op_t *op = &c->op;
    int n = c->n, me = c->me;
    int64_t es = op->esize, e = op->e, o = op->o, k = op->k;
    const void *rows[MAX_RANKS];
    switch (op->kind) {
    case K_ALL_REDUCE:
        if (!op->two) {
            for (int r = 0; r < n; r++) rows[r] = r == me ? op->a + o * es : slot_of(c, e, r);
            reduce_rows(c, op->a + o * es, rows, n, k);
        } else {
            int64_t lo, hi;
            span(part_length(k, n, es), k, me, &lo, &hi);
            if (hi > lo) {
                for (int r = 0; r < n; r++) rows[r] = r == me ? op->a + (o + lo) * es : slot_of(c, e, r) + lo * es;
                reduce_rows(c, slot_of(c, e + 1, me) + lo * es, rows, n, hi - lo);
            }
        }
        break;
    case K_REDUCE:
        if (me == op->root) {
            for (int r = 0; r < n; r++) rows[r] = r == me ? op->a + o * es : slot_of(c, e, r);
            reduce_rows(c, op->a + o * es, rows, n, k);
        }
        break;
    case K_BROADCAST:
        if (me != op->root) memcpy(op->a + o, slot_of(c, e, op->root), (size_t)k);
        break;
    case K_ALL_GATHER:
        for (int r = 0; r < n; r++)
            if (r != me) memcpy(op->a + r * op->numel + o, slot_of(c, e, r), (size_t)k);
        break;
    case K_REDUCE_SCATTER: {
        int64_t cap = cap_of(c, es, n);
        for (int r = 0; r < n; r++) rows[r] = r == me ? op->b + (me * op->m + o) * es : slot_of(c, e, r) + me * cap * es;
        reduce_rows(c, op->a + o * es, rows, n, k);
        break;
    }
    }
}

/* after the second round: every rank's part of the other buffer into the tensor */
static void chunk_out(ctx_t *c) {
    op_t *op = &c->op;
    int64_t es = op->esize, k = op->k, p = part_length(k, c->n, es);
    for (int r = 0; r < c->n; r++) {
        int64_t lo, hi;
        span(p, k, r, &lo, &hi);
        if (hi > lo) memcpy(op->a + (op->o + lo) * es, slot_of(c, op->e + 1, r) + lo * es, (size_t)((hi - lo) * es));
    }
}

static int64_t total_of(op_t *op) {
    switch (op->kind) {
    case K_BARRIER: return 0;
    case K_REDUCE_SCATTER: return op->m;
    default: return op->numel;
    }
}

/* run (or resume) the call in c->op */
static int drive(ctx_t *c) {
    op_t *op = &c->op;
    int rc;
    op->call_start = now_ns();
    for (;;) {
        switch (op->step) {
        case S_POST:
            if ((rc = post(c))) return rc;
            op->o = 0;
            op->step = (c->n > 1 && total_of(op) > 0) ? S_CHUNK : S_SETTLE;
            break;
        case S_CHUNK:
            op->e = c->st->epoch + 1;
            op->two = chunk_in(c);
            arrive(c, op->e);
            op->step = S_ROUND1;
            /* fall through */
        case S_ROUND1:
            if ((rc = round_wait(c, op->e))) return rc;
            chunk_mid(c);
            if (!op->two) {
                op->step = S_NEXT;
                break;
            }
            arrive(c, op->e + 1);
            op->step = S_ROUND2;
            /* fall through */
        case S_ROUND2:
            if ((rc = round_wait(c, op->e + 1))) return rc;
            chunk_out(c);
            op->step = S_NEXT;
            break;
        case S_NEXT:
            op->o += op->k;
            op->step = op->o < total_of(op) ? S_CHUNK : S_SETTLE;
            break;
        case S_SETTLE:
            if ((rc = settle(c))) return rc;
            op->step = -1;
            return RC_OK;
        default:
            return RC_ARG;
        }
    }
}

/* ---------------------------------------------------------------- kernel choice */

/* is this width's vector code compiled into this library? */
static int isa_compiled(int isa) { return isa == ISA_SCALAR || (VEC_COMPILED && (isa == ISA_AVX2 || isa == ISA_AVX512)); }

#if VEC_COMPILED
/* The CPU's widths from CPUID and the OS's saved state (XGETBV), read here rather than through
 * __builtin_cpu_supports: zig cc's runtime stubs that out (it says no width), and a width the
 * CPU has but the OS does not save the registers of cannot run. */
static void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    __asm__ __volatile__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static int cpu_widths(void) { /* bit 1: avx2, bit 2: avx512 (f, bw, vl) */
    unsigned r[4], lo, hi;
    cpuid(0, 0, r);
    if (r[0] < 7) return 0;
    cpuid(1, 0, r);
    if (!(r[2] & (1u << 27)) || !(r[2] & (1u << 28))) return 0; /* OSXSAVE, AVX */
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    cpuid(7, 0, r);
    int out = ((lo & 0x6u) == 0x6u && (r[1] & (1u << 5))) ? 2 : 0; /* XMM, YMM state; AVX2 */
    unsigned avx512 = (1u << 16) | (1u << 30) | (1u << 31);      /* AVX512F, BW, VL */
    if (out && (lo & 0xE0u) == 0xE0u && (r[1] & avx512) == avx512) out |= 4; /* opmask, ZMM state */
    return out;
}
#endif

/* does this CPU run this width, compiled in? */
static int isa_supported(int isa) {
#if VEC_COMPILED
    static int known = -1; /* every thread computes the same value: relaxed is enough */
    int widths = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (widths < 0) __atomic_store_n(&known, widths = cpu_widths(), __ATOMIC_RELAXED);
    if (isa == ISA_AVX512 || isa == ISA_AVX2) return (widths >> isa) & 1;
#endif
    return isa == ISA_SCALAR;
}

static rows_fn pick(int isa, int op, int dtype) {
    if (op == OPC_AVG) op = OPC_SUM; /* the binding divides */
#if VEC_COMPILED
    if (isa == ISA_AVX512) return kernel_avx512(op, dtype);
    if (isa == ISA_AVX2) return kernel_avx2(op, dtype);
#endif
    (void)isa;
    return kernel_scalar(op, dtype);
}

static int64_t esize_of(int dtype) {
    switch (dtype) {
    case DT_F64: case DT_I64: return 8;
    case DT_F32: case DT_I32: return 4;
    case DT_F16: case DT_BF16: case DT_I16: return 2;
    case DT_I8: case DT_U8: return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the interface (ctypes) */

int cpuddp_shm_abi(void) { return ABI; }
int cpuddp_shm_isa_supported(int isa) { return isa_supported(isa); }
int cpuddp_shm_isa_compiled(int isa) { return isa_compiled(isa); }
int cpuddp_shm_best_isa(void) {
    return isa_supported(ISA_AVX512) ? ISA_AVX512 : isa_supported(ISA_AVX2) ? ISA_AVX2 : ISA_SCALAR;
}
/* does this file reduce (op, dtype)? */
int cpuddp_shm_reduces(int op, int dtype) { return esize_of(dtype) && pick(ISA_SCALAR, op, dtype) != 0; }
int64_t cpuddp_shm_ctx_size(void) { return (int64_t)sizeof(ctx_t); }

/* set up a context in memory the binding owns (cpuddp_shm_ctx_size bytes) */
int cpuddp_shm_init(ctx_t *c, state_t *st, void *base, int64_t counters_at, int64_t ring_at, int64_t slots_at,
                    int64_t slot, int64_t total, int n, int me, int fd, const int *pidfds, int spin, int isa,
                    int64_t timeout_ns) {
    if (n < 1 || n > MAX_RANKS || me < 0 || me >= n || slot < ALIGN * n || !isa_supported(isa)) return RC_ARG;
    memset(c, 0, sizeof *c);
    c->st = st;
    c->base = base;
    c->counters_at = counters_at;
    c->ring_at = ring_at;
    c->slots_at = slots_at;
    c->slot = slot;
    c->total = total;
    c->n = n;
    c->me = me;
    c->fd = fd;
    c->spin = spin;
    c->isa = isa;
    c->timeout_ns = timeout_ns;
    for (int r = 0; r < n; r++) c->pidfd[r] = pidfds ? pidfds[r] : -1;
    c->op.step = -1;
    if (pthread_mutex_init(&c->q.lock, NULL)) return RC_ARG;
    return RC_OK;
}

/* what the binding checks a library against (layout.h, as this library was built from it) */
int64_t cpuddp_shm_entry_size(void) { return (int64_t)sizeof(entry_t); }
int64_t cpuddp_shm_state_size(void) { return (int64_t)sizeof(state_t); }

static const struct {
    const char *name;
    int64_t value;
} LAYOUT[] = {
#define CPUDDP_SHM_ROW(name, value, what) {#name, (int64_t)(value)},
    CPUDDP_SHM_TABLES(CPUDDP_SHM_ROW)
#undef CPUDDP_SHM_ROW
};
int cpuddp_shm_layout_count(void) { return (int)(sizeof LAYOUT / sizeof LAYOUT[0]); }
/* value i of layout.h's tables, in the file's order, and its name (NULL past the end) */
const char *cpuddp_shm_layout_name(int i) { return i >= 0 && i < cpuddp_shm_layout_count() ? LAYOUT[i].name : 0; }
int64_t cpuddp_shm_layout_value(int i) { return i >= 0 && i < cpuddp_shm_layout_count() ? LAYOUT[i].value : 0; }

/* are the call's two tensors apart, as its rounds need?  all_gather's input may be exactly this
 * rank's row of the output and share no other byte with it; reduce_scatter's share none (a
 * round writes the output while later rounds still read the input).  By address: two storages
 * may hold one memory */
static int apart(const ctx_t *c, const op_t *p, const void *a, const void *b) {
    int64_t an, bn;
    if (p->kind == K_ALL_GATHER) {
        if ((const char *)b == (const char *)a + (int64_t)c->me * p->numel) return 1;
        an = (int64_t)c->n * p->numel, bn = p->numel;
    } else if (p->kind == K_REDUCE_SCATTER && c->n > 1) { /* one rank: no round, a memmove */
        an = p->m * p->esize, bn = (int64_t)c->n * p->m * p->esize;
    } else {
        return 1;
    }
    uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return an <= 0 || bn <= 0 || a0 + (uintptr_t)an <= b0 || b0 + (uintptr_t)bn <= a0;
}

/* run one collective: a and b are the call's tensors (b: the input of all_gather and
 * reduce_scatter), both checked by the binding against the entry's sizes */
/* set c->op up for one call: a and b are the call's tensors (b: the input of all_gather and
 * reduce_scatter), both checked by the binding against the entry's sizes */
static int prepare(ctx_t *c, const entry_t *en, void *a, void *b, int64_t slice_ns) {
    op_t *p = &c->op;
    if (en->kind < K_ALL_REDUCE || en->kind > K_REDUCE || en->numel < 0 || en->m < 0 ||
        en->root < 0 || en->root >= c->n)
        return RC_ARG;
    memset(p, 0, sizeof *p);
    p->step = -1; /* no call in progress until this one is ready (a refused call leaves none) */
    p->kind = (int)en->kind;
    p->dtype = (int)en->dtype;
    p->op = (int)en->op;
    p->root = (int)en->root;
    p->a = a;
    p->b = b;
    p->numel = en->numel;
    p->m = en->m;
    p->slice_ns = slice_ns;
    p->esize = en->dtype >= 0 ? esize_of((int)en->dtype) : 1;
    memcpy(p->desc, en->desc, sizeof p->desc);
    if (p->kind == K_ALL_REDUCE || p->kind == K_REDUCE || p->kind == K_REDUCE_SCATTER) {
        p->fn = pick(c->isa, p->op, p->dtype);
        if (!p->fn || !p->esize) return RC_ARG;
    }
    if (!apart(c, p, a, b)) return RC_ARG; /* the binding never passes such tensors: refused, not copied */
    if (p->kind == K_ALL_GATHER && p->numel && (char *)a + (int64_t)c->me * p->numel != (char *)b)
        memcpy((char *)a + (int64_t)c->me * p->numel, b, (size_t)p->numel); /* this rank's own row */
    if (p->kind == K_REDUCE_SCATTER && c->n == 1 && p->m && a != b)
        memmove(a, b, (size_t)(p->m * p->esize)); /* one rank: no round runs, its part is its input */
    p->step = S_POST;
    return RC_OK;
}

static int pending(ctx_t *c) {
    return __atomic_load_n(&c->q.head, __ATOMIC_ACQUIRE) != __atomic_load_n(&c->q.tail, __ATOMIC_ACQUIRE);
}

/* run one collective in the caller's thread.  RC_BUSY: the progress thread holds calls queued
 * before this one, which must run first (issue order) -- nothing was done; the caller waits
 * for them (cpuddp_shm_drain), then calls again */
int cpuddp_shm_call(ctx_t *c, const entry_t *en, void *a, void *b) {
    if (c->q.started && pending(c)) return RC_BUSY; /* first: the thread's call owns c->op */
    if (c->op.step != -1) return RC_ARG; /* a call is in progress: resume it */
    int rc = prepare(c, en, a, b, WAIT_SLICE_NS);
    if (rc) return rc;
    rc = drive(c);
    if (rc != RC_AGAIN) c->op.step = -1;
    return rc;
}

int cpuddp_shm_resume(ctx_t *c) {
    if (c->op.step == -1) return RC_ARG;
    int rc = drive(c);
    if (rc != RC_AGAIN) c->op.step = -1;
    return rc;
}

/* drop a call that returned AGAIN (the group is broken after it) */
void cpuddp_shm_drop(ctx_t *c) { c->op.step = -1; }

/* ---------------------------------------------------------------- the progress thread */

static void futex_wait(uint32_t *word, uint32_t seen, int64_t ns) {
    struct timespec ts = {ns / 1000000000, ns % 1000000000};
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
}
static void futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

/* the thread: run each queued call in order, then publish its result */
static void *progress(void *arg) {
    ctx_t *c = arg;
    queue_t *q = &c->q;
    for (;;) {
        uint32_t rung = __atomic_load_n(&q->bell, __ATOMIC_ACQUIRE);
        int64_t t = __atomic_load_n(&q->head, __ATOMIC_ACQUIRE);
        if (t == __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE)) {
            /* closing seen: every submit before it is visible (the lock orders them), so look again */
            if (__atomic_load_n(&q->closing, __ATOMIC_ACQUIRE)) {
                if (t == __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE)) return 0;
                continue;
            }
            int64_t start = now_ns(); /* spin briefly (a call right behind the last), then sleep */
            while (c->spin && now_ns() - start < QUEUE_SPIN_NS && t == __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE))
                cpu_relax();
            if (t == __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE)) futex_wait(&q->bell, rung, 100000000);
            continue;
        }
        job_t *j = &q->jobs[t % QUEUE];
        int rc = __atomic_load_n(&q->closing, __ATOMIC_ACQUIRE) ? RC_CLOSED : prepare(c, &j->en, j->a, j->b, 0);
        if (rc == RC_OK) {
            c->op.queued = 1;
            rc = drive(c);
        }
        c->op.step = -1;
        j->err[0] = c->st->err_peer, j->err[1] = c->st->err_where, j->err[2] = c->st->err_value;
        j->rc = rc;
        __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
        futex_wake(&j->done);
        __atomic_store_n(&q->head, t + 1, __ATOMIC_RELEASE);
    }
}

/* start the context's progress thread (every signal blocked in it: they stay the main thread's) */
int cpuddp_shm_start(ctx_t *c) {
    if (c->q.started) return RC_OK;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int err = pthread_create(&c->q.thread, NULL, progress, c);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) return RC_ARG;
    c->q.started = 1;
    return RC_OK;
}

/* queue one call; its ticket (>= 0), or -RC_CLOSED after stop, or -RC_BUSY: the queue holds
 * QUEUE calls whose results were not taken -- nothing was done; the caller takes the oldest
 * result (cpuddp_shm_wait), then submits again */
int64_t cpuddp_shm_submit(ctx_t *c, const entry_t *en, void *a, void *b) {
    queue_t *q = &c->q;
    if (!q->started) return -RC_CLOSED;
    pthread_mutex_lock(&q->lock);
    if (__atomic_load_n(&q->closing, __ATOMIC_ACQUIRE)) {
        pthread_mutex_unlock(&q->lock);
        return -RC_CLOSED;
    }
    int64_t t = q->tail;
    if (t - __atomic_load_n(&q->taken, __ATOMIC_ACQUIRE) >= QUEUE) {
        pthread_mutex_unlock(&q->lock);
        return -RC_BUSY;
    }
    job_t *j = &q->jobs[t % QUEUE];
    j->en = *en;
    j->a = a, j->b = b;
    j->ticket = t;
    j->rc = 0;
    __atomic_store_n(&j->done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&q->tail, t + 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&q->lock);
    __atomic_fetch_add(&q->bell, 1, __ATOMIC_RELEASE);
    futex_wake(&q->bell);
    return t;
}

/* wait (GIL released by ctypes) up to timeout_ns for call `ticket`, the oldest result not yet
 * taken: its result, or RC_AGAIN; err gets the error's peer, place and value.  One thread
 * takes the results, in ticket order (the binding's waiter). */
int cpuddp_shm_wait(ctx_t *c, int64_t ticket, int64_t timeout_ns, int64_t *err) {
    queue_t *q = &c->q;
    if (ticket != __atomic_load_n(&q->taken, __ATOMIC_ACQUIRE) || ticket >= __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE))
        return RC_ARG;
    job_t *j = &q->jobs[ticket % QUEUE];
    int64_t end = now_ns() + timeout_ns;
    while (!__atomic_load_n(&j->done, __ATOMIC_ACQUIRE) || __atomic_load_n(&q->head, __ATOMIC_ACQUIRE) <= ticket) {
        int64_t left = end - now_ns();
        if (left <= 0) return RC_AGAIN;
        futex_wait(&j->done, 0, left < 100000000 ? left : 100000000);
    }
    memcpy(err, j->err, sizeof j->err);
    int rc = j->rc;
    __atomic_store_n(&q->taken, ticket + 1, __ATOMIC_RELEASE);
    return rc;
}

/* wait (GIL released by ctypes) up to timeout_ns until the thread has run every call queued so
 * far: RC_OK, or RC_AGAIN (call again).  What a caller does on RC_BUSY; their results stay
 * for cpuddp_shm_wait */
int cpuddp_shm_drain(ctx_t *c, int64_t timeout_ns) {
    queue_t *q = &c->q;
    int64_t last = __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE) - 1;
    int64_t end = now_ns() + timeout_ns;
    while (__atomic_load_n(&q->head, __ATOMIC_ACQUIRE) <= last) {
        int64_t left = end - now_ns();
        if (left <= 0) return RC_AGAIN;
        /* the last job's done word: set before head passes it (a later submit may reuse its
         * place only after head passed it: then the loop ends at its next look) */
        futex_wait(&q->jobs[last % QUEUE].done, 0, left < 1000000 ? left : 1000000);
    }
    return RC_OK;
}

/* calls queued and not finished */
int64_t cpuddp_shm_pending(ctx_t *c) {
    return __atomic_load_n(&c->q.tail, __ATOMIC_ACQUIRE) - __atomic_load_n(&c->q.head, __ATOMIC_ACQUIRE);
}

/* stop the thread: a queued call waiting for peers ends with RC_CLOSED, the ones behind it too;
 * joined.  A call in the caller's thread is not the thread's: it runs and waits as before */
void cpuddp_shm_stop(ctx_t *c) {
    queue_t *q = &c->q;
    if (!q->started) return;
    pthread_mutex_lock(&q->lock);
    __atomic_store_n(&q->closing, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&q->lock);
    __atomic_fetch_add(&q->bell, 1, __ATOMIC_RELEASE);
    futex_wake(&q->bell);
    pthread_join(q->thread, NULL);
    q->started = 0; /* later submits get RC_CLOSED; calls in the caller's thread wait as before */
    __atomic_store_n(&q->closing, 0, __ATOMIC_RELEASE);
}

/* a full memory fence: the Python engine's order on CPUs that reorder stores and loads (see the top) */
void cpuddp_shm_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

/* the kernels alone (tests): out = rows[0] op rows[1] ... at width isa */
int cpuddp_shm_reduce_rows(int isa, int op, int dtype, void *out, const void *const *rows, int k, int64_t m) {
    if (!isa_supported(isa) || k < 1 || k > MAX_RANKS || m < 0) return RC_ARG;
    rows_fn fn = pick(isa, op, dtype);
    if (!fn || !esize_of(dtype)) return RC_ARG;
    int64_t units = (op == OPC_BAND || op == OPC_BOR || op == OPC_BXOR) ? m * esize_of(dtype) : m;
    fn(out, rows, k, units);
    return RC_OK;
}

#ifndef CPUDDP_SRC_DIGEST
#define CPUDDP_SRC_DIGEST "unknown"
#endif
/* the digest of the sources this library was built from (the binding refuses a stale build) */
const char *cpuddp_shm_digest(void) { return CPUDDP_SRC_DIGEST; }
