/* The shm engine's shared facts, each defined here once: the node's segment (its areas, its
 * header words, a rank's control line), the native library's interface (its version, results,
 * collectives, the structs it shares with its binding) and the wait policy of both engines.
 *
 * Who reads it: engine.c makes an enum of each table and the structs of the field lists (and so
 * do tests/native/threads.c and kernels.c, which include engine.c); Python reads this file as
 * text, with no compiler and no library (cpuddp/backends/shm/native/layout.py), so the Python
 * engine, the binding and the C code use the same names and numbers.  The binding asks a loaded
 * library for its copy of every value and the sizes of its structs, and refuses one built from
 * another layout, naming the word.
 *
 * The form, which layout.py holds the file to: a table is `#define CPUDDP_SHM_<NAME>(X)` and
 * lines `X(NAME, value, "what it is")` -- a NAME in capitals, an integer literal, a one-line
 * string; a field list is `#define CPUDDP_SHM_<NAME>_FIELDS(F)` and lines `F(name, "what it is")`,
 * each an int64.
 */
#ifndef CPUDDP_SHM_LAYOUT_H
#define CPUDDP_SHM_LAYOUT_H

#include <stdint.h>

/* ------------------------------------------------------------------ the segment
 * A header page, one control line per local rank, the descriptor rings (entry-major: rank r's
 * entry i at ring + (i * ranks + r) * DESC), then two buffers (parities) of one slot per rank;
 * each area starts at a multiple of PAGE (cpuddp/backends/shm/protocol/check.py's layout()). */
#define CPUDDP_SHM_SIZES(X) \
    X(PAGE, 4096, "bytes of the header; each area of the segment starts at a multiple of it") \
    X(LINE, 128, "bytes of a rank's control line (adjacent-line prefetch pairs 64-byte lines)") \
    X(RING, 16, "descriptor entries per rank: call s is posted after every peer checked call s - RING") \
    X(DESC, 64, "bytes of a descriptor entry: its call number, then DESC_WORDS words") \
    X(DESC_WORDS, 7, "words of a descriptor after its call number") \
    X(ALIGN, 64, "bytes: a slot's regions, and the parts of a chunk, start at a multiple of it")

/* the header page: int64 words, then two words of the native engine's futex */
#define CPUDDP_SHM_HEADER(X) \
    X(W_MAGIC, 0, "int64 word: MAGIC, once local rank 0 wrote the rest") \
    X(W_SIZE, 1, "int64 word: the node's local ranks") \
    X(W_SLOT, 2, "int64 word: bytes per slot") \
    X(W_TOKEN, 3, "int64 word: the group's random token (its offer names it)") \
    X(W_ABORT, 4, "int64 word: local rank + 1 of the first rank that gave up, or 0") \
    X(W_RING, 5, "int64 word: RING") \
    X(HEADER_WORDS, 8, "int64 words of the header that Python maps") \
    X(BELL_AT, 128, "byte: the futex word (uint32) rung after a counter rises while a waiter sleeps") \
    X(SLEEPERS_AT, 192, "byte: how many waiters sleep on the bell (int32)")

/* what W_MAGIC holds (a 64-bit value: this table makes no C enum) */
#define CPUDDP_SHM_IDENTITY(X) \
    X(MAGIC, 0x6370756464707368, "the header's W_MAGIC: the ASCII of cpuddpsh")

/* a rank's control line: int64 words, then its note */
#define CPUDDP_SHM_LINE(X) \
    X(C_ARRIVED, 0, "int64 word: the last round this rank arrived at (its slot written for it)") \
    X(C_POSTED, 1, "int64 word: the last call whose descriptor this rank posted") \
    X(C_CHECKED, 2, "int64 word: the last call this rank compared (it read nothing of earlier calls after)") \
    X(C_STATE, 3, "int64 word: STATE_LIVE or STATE_LEFT") \
    X(C_NUMA, 4, "int64 word: this rank's NUMA node as python/levels.py codes it") \
    X(C_NATIVE, 5, "int64 word: this rank's native library token, while the group forms") \
    X(LINE_WORDS, 6, "int64 words at the start of a line") \
    X(NOTE_AT, 48, "byte of the line: why this rank has no NUMA node (utf-8, NUL-padded)") \
    X(NOTE_BYTES, 80, "bytes of that note: the rest of the line") \
    X(STATE_LIVE, 0, "C_STATE: a member of the group") \
    X(STATE_LEFT, 1, "C_STATE: left the group; its process lives on")

/* ------------------------------------------------------------------ the native library's interface */
#define CPUDDP_SHM_INTERFACE(X) \
    X(ABI, 2, "the interface's version: the binding loads a library of its own ABI only") \
    X(RC_OK, 0, "done") \
    X(RC_AGAIN, 1, "waited one slice (WAIT_SLICE_NS): resume the call after Python ran its signal handlers") \
    X(RC_MISMATCH, 2, "a peer posted another call") \
    X(RC_DEAD, 3, "a peer died") \
    X(RC_LEFT, 4, "a peer left the group") \
    X(RC_ABORT, 5, "a rank gave up (W_ABORT)") \
    X(RC_TIMEOUT, 6, "the group's timeout passed") \
    X(RC_ARG, 7, "refused: an argument the binding should have refused first") \
    X(RC_BUSY, 8, "the progress queue holds calls this one must follow; nothing was done: wait, then again") \
    X(RC_CLOSED, 9, "the progress thread was stopped") \
    X(AT_POST, 1, "an error's place: waiting to post (peers to check call s - RING)") \
    X(AT_SETTLE, 2, "an error's place: comparing the call's descriptors") \
    X(AT_ROUND, 3, "an error's place: a round of the data") \
    X(K_ALL_REDUCE, 1, "a collective the library runs") \
    X(K_BROADCAST, 2, "a collective the library runs") \
    X(K_BARRIER, 3, "a collective the library runs") \
    X(K_ALL_GATHER, 4, "a collective the library runs") \
    X(K_REDUCE_SCATTER, 5, "a collective the library runs") \
    X(K_REDUCE, 6, "a collective the library runs") \
    X(ISA_SCALAR, 0, "a vector width: plain C") \
    X(ISA_AVX2, 1, "a vector width: AVX2") \
    X(ISA_AVX512, 2, "a vector width: AVX-512 (F, BW, VL)")

/* a context's counters, which the binding owns (its Counters; engine.c's state_t) */
#define CPUDDP_SHM_STATE_FIELDS(F) \
    F(seq, "the last call this rank posted") \
    F(epoch, "the last round this rank arrived at") \
    F(calls, "collectives agreed so far") \
    F(unchecked, "a posted call not compared yet (its number), or 0") \
    F(err_peer, "the local rank an error names") \
    F(err_where, "where it waited: AT_POST, AT_SETTLE, AT_ROUND") \
    F(err_value, "the call number or round it waited for")

/* a prepared call (the binding's entry; engine.c's entry_t): the descriptor's DESC_WORDS words,
 * then these */
#define CPUDDP_SHM_ENTRY_FIELDS(F) \
    F(kind, "K_ALL_REDUCE ... K_REDUCE") \
    F(dtype, "the descriptor's dtype code; -1: bytes") \
    F(op, "torch's ReduceOp code") \
    F(root, "the root's local rank") \
    F(numel, "elements of the first tensor") \
    F(m, "elements of the output's part (reduce_scatter), else numel")

/* ------------------------------------------------------------------ the wait policy
 * One policy for every wait for the node's peers, in both engines (the native one: engine.c's
 * wait_words; the Python one: cpuddp/backends/shm/protocol/wait.py), and for the hand-offs to a
 * group's threads (routes/stream.py).  A wait first pause-spins WAIT_SPIN_NS (native only:
 * Python has no pause); then polls with sched_yield for WAIT_YIELD_NS when every local rank has
 * a CPU of its own (a peer's arrival is seen within a microsecond or two, and the yield hands the
 * CPU to any thread that wants it), or WAIT_YIELD_SHARED_NS when ranks share CPUs (so the peer
 * that shares it runs; longer would hold a CPU the peer needs); then sleeps, each sleep at most
 * 1/WAIT_SLEEP_SHARE of the time waited so far, from WAIT_SLEEP_MIN_NS to WAIT_SLEEP_MAX_NS (a
 * sleep costs at most ~1/8 more than the wait it ends, and a wait of seconds wakes ~450 times a
 * second, not thousands).  The native engine sleeps on the segment's futex (BELL_AT), which a
 * rank rings after raising a counter while a waiter sleeps: it wakes at the peer's arrival.
 * Every WAIT_CHECK_NS a wait looks at each late peer: alive (its lock on the segment, its
 * pidfd), still in the group, no rank gave up (W_ABORT), its descriptor not already different;
 * at the group's timeout it fails.  A native call returns RC_AGAIN every WAIT_SLICE_NS of
 * waiting, so Python's signal handlers (Ctrl-C) run; the call resumes where it stopped, its
 * wait's clock kept. */
#define CPUDDP_SHM_WAIT(X) \
    X(WAIT_SPIN_NS, 2000, "ns of pause-spinning first (native only)") \
    X(WAIT_YIELD_NS, 2000000, "ns of sched_yield polling when every local rank has a CPU of its own") \
    X(WAIT_YIELD_SHARED_NS, 200000, "ns of it when ranks share CPUs") \
    X(WAIT_SLEEP_MIN_NS, 50000, "ns: the shortest sleep") \
    X(WAIT_SLEEP_MAX_NS, 2000000, "ns: the longest sleep") \
    X(WAIT_SLEEP_SHARE, 8, "a sleep is at most 1/WAIT_SLEEP_SHARE of the time waited so far") \
    X(WAIT_CHECK_NS, 20000000, "ns between looks at the late peers") \
    X(WAIT_SLICE_NS, 50000000, "ns a native call waits before it returns RC_AGAIN")

/* every table of values, in this file's order */
#define CPUDDP_SHM_TABLES(X) \
    CPUDDP_SHM_SIZES(X) CPUDDP_SHM_HEADER(X) CPUDDP_SHM_IDENTITY(X) CPUDDP_SHM_LINE(X) \
    CPUDDP_SHM_INTERFACE(X) CPUDDP_SHM_WAIT(X)

/* ------------------------------------------------------------------ C's view */
#define CPUDDP_SHM_ENUM(name, value, what) name = value,
enum { CPUDDP_SHM_SIZES(CPUDDP_SHM_ENUM) };
enum { CPUDDP_SHM_HEADER(CPUDDP_SHM_ENUM) };
enum { CPUDDP_SHM_LINE(CPUDDP_SHM_ENUM) };
enum { CPUDDP_SHM_INTERFACE(CPUDDP_SHM_ENUM) };
enum { CPUDDP_SHM_WAIT(CPUDDP_SHM_ENUM) };
#undef CPUDDP_SHM_ENUM

#define CPUDDP_SHM_INT64_FIELD(name, what) int64_t name;
typedef struct {
    CPUDDP_SHM_STATE_FIELDS(CPUDDP_SHM_INT64_FIELD)
} state_t;

typedef struct {
    int64_t desc[DESC_WORDS]; /* the descriptor every rank compares */
    CPUDDP_SHM_ENTRY_FIELDS(CPUDDP_SHM_INT64_FIELD)
} entry_t;
#undef CPUDDP_SHM_INT64_FIELD

/* the relations between the numbers above */
_Static_assert(DESC == 8 * (1 + DESC_WORDS), "a descriptor entry: its call number and DESC_WORDS words");
_Static_assert(NOTE_AT == 8 * LINE_WORDS && NOTE_AT + NOTE_BYTES == LINE, "a line: its words, then its note");
_Static_assert(8 * HEADER_WORDS <= BELL_AT && BELL_AT + 4 <= SLEEPERS_AT && SLEEPERS_AT + 4 <= PAGE,
               "the header: its words, then the bell and the sleepers, apart");
_Static_assert(PAGE % LINE == 0 && PAGE % DESC == 0 && PAGE % ALIGN == 0, "every area aligned");

#endif
