/* The reduction kernels' results as digests, one line per dtype and op, so two builds can be
 * compared bit for bit: .ci/native.sh builds this file for x86-64 and for aarch64 (run under
 * qemu-aarch64) and diffs the scalar lines -- the x86 scalar kernels are checked against torch's
 * bits by tests/test_shm_native.py, so equal lines carry that check to aarch64, where no torch
 * runs here.  On the CPU it runs on it also compares every vector width the CPU has with the
 * scalar code and exits 1 at the first difference.  Inputs: fixed pseudo-random bits with
 * NaN, infinities, signed zeros, subnormals and the extremes mixed in, rows of 1-17 ranks,
 * lengths 0-1000, unaligned.  Digests treat every NaN as one value (payloads may differ) and,
 * for MIN and MAX, +0 and -0 as one (either sign is right: tests/test_shm_native.py's _same).
 * Built together with engine.c (included):
 *   cc -O2 -std=c11 -pthread -ffp-contract=off -I cpuddp/backends/shm/native tests/native/kernels.c
 * Usage: kernels [scalar]   (scalar: print only the scalar lines, no width comparison) */
#include "engine.c"
#include <stdio.h>

static uint64_t STATE;
static uint64_t next_bits(void) { /* xorshift64*: the same sequence on every CPU */
    STATE ^= STATE >> 12, STATE ^= STATE << 25, STATE ^= STATE >> 27;
    return STATE * 2685821657736338717ULL;
}

/* one element's bits: random, or (one in eight) a hard case of its dtype */
static void fill_one(int dtype, unsigned char *p) {
    static const uint32_t f32[] = {0x7FC00000u, 0x7F800000u, 0xFF800000u, 0x00000000u, 0x80000000u, 0x00000001u,
                                   0x7F7FFFFFu, 0xFF7FFFFFu};
    static const uint64_t f64[] = {0x7FF8000000000000ull, 0x7FF0000000000000ull, 0xFFF0000000000000ull, 0ull,
                                   0x8000000000000000ull, 1ull, 0x7FEFFFFFFFFFFFFFull, 0xFFEFFFFFFFFFFFFFull};
    static const uint16_t f16[] = {0x7E00, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x7BFF, 0xFBFF};
    static const uint16_t bf16[] = {0x7FC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x7F7F, 0xFF7F};
    uint64_t r = next_bits();
    int special = (r & 7) == 0;
    int pick = (int)((r >> 3) & 7);
    uint64_t bits = next_bits();
    switch (dtype) {
    case DT_F32: { uint32_t v = special ? f32[pick] : (uint32_t)bits; memcpy(p, &v, 4); return; }
    case DT_F64: { uint64_t v = special ? f64[pick] : bits; memcpy(p, &v, 8); return; }
    case DT_F16: { uint16_t v = special ? f16[pick] : (uint16_t)bits; memcpy(p, &v, 2); return; }
    case DT_BF16: { uint16_t v = special ? bf16[pick] : (uint16_t)bits; memcpy(p, &v, 2); return; }
    default: memcpy(p, &bits, (size_t)esize_of(dtype)); return;
    }
}

static int is_nan(int dtype, const unsigned char *p) {
    switch (dtype) {
    case DT_F32: { uint32_t v; memcpy(&v, p, 4); return (v & 0x7F800000u) == 0x7F800000u && (v & 0x7FFFFFu); }
    case DT_F64: { uint64_t v; memcpy(&v, p, 8);
                   return (v & 0x7FF0000000000000ull) == 0x7FF0000000000000ull && (v & 0xFFFFFFFFFFFFFull); }
    case DT_F16: { uint16_t v; memcpy(&v, p, 2); return (v & 0x7C00) == 0x7C00 && (v & 0x3FF); }
    case DT_BF16: { uint16_t v; memcpy(&v, p, 2); return (v & 0x7F80) == 0x7F80 && (v & 0x7F); }
    }
    return 0;
}

static int is_zero(int dtype, const unsigned char *p) {
    int64_t es = esize_of(dtype);
    for (int64_t i = 0; i < es - 1; i++)
        if (p[i]) return 0;
    return (p[es - 1] & 0x7F) == 0; /* little-endian: the sign is the last byte's top bit */
}

static int floating(int dtype) { return dtype == DT_F32 || dtype == DT_F64 || dtype == DT_F16 || dtype == DT_BF16; }

/* FNV-1a over the elements, canonical NaN, and for MIN/MAX one zero */
static uint64_t digest(uint64_t h, int dtype, int op, const unsigned char *out, int64_t m) {
    int64_t es = esize_of(dtype);
    for (int64_t i = 0; i < m; i++) {
        const unsigned char *p = out + i * es;
        unsigned char canon[8] = {0};
        if (floating(dtype) && is_nan(dtype, p)) canon[0] = 0xAA, p = canon;
        else if (floating(dtype) && (op == OPC_MIN || op == OPC_MAX) && is_zero(dtype, p)) p = canon;
        for (int64_t b = 0; b < es; b++) h = (h ^ p[b]) * 1099511628211ULL;
    }
    return h;
}

int main(int argc, char **argv) {
    int scalar_only = argc > 1 && strcmp(argv[1], "scalar") == 0;
    static const char *dtypes[] = {"float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
                                   "int64"};
    static const char *ops[] = {"sum", "avg", "prod", "min", "max", "band", "bor", "bxor"};
    static const int ranks[] = {1, 2, 3, 5, 8, 17};
    static const int64_t lengths[] = {0, 1, 15, 33, 513, 1000};
    enum { MAXM = 1000, PAD = 3 };
    unsigned char *rows = malloc((size_t)17 * (MAXM + PAD) * 8);
    unsigned char *out = malloc((size_t)MAXM * 8), *ref = malloc((size_t)MAXM * 8);
    int lines = 0;
    for (int dtype = DT_F32; dtype <= DT_I64; dtype++) {
        for (int op = OPC_SUM; op <= OPC_BXOR; op++) {
            if (op == OPC_AVG || !cpuddp_shm_reduces(op, dtype)) continue; /* AVG: SUM's kernel, the binding divides */
            int64_t es = esize_of(dtype);
            uint64_t h = 1469598103934665603ULL;
            for (size_t ni = 0; ni < sizeof ranks / sizeof *ranks; ni++) {
                for (size_t mi = 0; mi < sizeof lengths / sizeof *lengths; mi++) {
                    int n = ranks[ni];
                    int64_t m = lengths[mi];
                    STATE = 0x9E3779B97F4A7C15ULL ^ (uint64_t)(dtype * 1000003 + op * 10007 + n * 101 + (int)m);
                    const void *ptrs[MAX_RANKS];
                    for (int r = 0; r < n; r++) {
                        unsigned char *row = rows + (size_t)r * (MAXM + PAD) * (size_t)es;
                        for (int64_t i = 0; i < m + PAD; i++) fill_one(dtype, row + i * es);
                        ptrs[r] = row + PAD * es; /* unaligned rows */
                    }
                    if (cpuddp_shm_reduce_rows(ISA_SCALAR, op, dtype, ref, ptrs, n, m)) {
                        fprintf(stderr, "%s %s: refused\n", dtypes[dtype], ops[op]);
                        return 2;
                    }
                    h = digest(h, dtype, op, ref, m);
                    for (int isa = ISA_AVX2; !scalar_only && isa <= ISA_AVX512; isa++) {
                        if (!isa_supported(isa)) continue;
                        cpuddp_shm_reduce_rows(isa, op, dtype, out, ptrs, n, m);
                        if (digest(0, dtype, op, out, m) != digest(0, dtype, op, ref, m)) {
                            fprintf(stderr, "%s %s, %d rows of %lld: vector width %d differs from the scalar code\n",
                                    dtypes[dtype], ops[op], n, (long long)m, isa);
                            return 1;
                        }
                    }
                }
            }
            printf("%s %s %016llx\n", dtypes[dtype], ops[op], (unsigned long long)h);
            lines++;
        }
    }
    fprintf(stderr, "ok: %d dtype/op digests\n", lines);
    free(rows), free(out), free(ref);
    return 0;
}
