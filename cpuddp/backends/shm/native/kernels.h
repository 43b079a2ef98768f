/* cpuddp shm native engine: the reduce kernels, compiled once per vector width.
 *
 * This file is included three times by engine.c, each time with KSUFFIX set (scalar, avx2,
 * avx512) and, on x86, inside a target region (GCC's `#pragma GCC target`, clang's `#pragma clang
 * attribute`): the compiler vectorises the same loops for that width, and engine.c picks a width at run time from the CPU (never -march).
 * Every loop is elementwise across the message and runs over the ranks' rows in rank order:
 * out[j] = ((row0[j] op row1[j]) op row2[j]) ...  No reassociation, no contraction
 * (-ffp-contract=off, no -ffast-math): the result is the same bits on every rank and at every
 * width, and the Python engine's (cpuddp.backends.shm.python.ops) where its order is this one.
 * Integer arithmetic is done on unsigned types (wrapping, no undefined behaviour); MIN/MAX
 * propagate NaN like torch.minimum/maximum; float16 and bfloat16 round to their type after
 * each operation, as torch's elementwise ops on those types do. */

#define KCAT2(a, b) a##_##b
#define KCAT(a, b) KCAT2(a, b)
#define KNAME(name) KCAT(name, KSUFFIX)

/* one operation on values of type T (float types: NaN-propagating min/max as torch) */
#define OP_SUM(a, b) ((a) + (b))
#define OP_PROD(a, b) ((a) * (b))
/* narrow integer product through uint32 (narrow operands promote to int: overflow is UB), wrapped */
#define OP_PROD16(a, b) ((uint32_t)(a) * (uint32_t)(b))
#define OP_BAND(a, b) ((a) & (b))
#define OP_BOR(a, b) ((a) | (b))
#define OP_BXOR(a, b) ((a) ^ (b))
#define OP_IMIN(a, b) ((b) < (a) ? (b) : (a))
#define OP_IMAX(a, b) ((b) > (a) ? (b) : (a))
#define OP_FMIN(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (b) < (a) ? (b) : (a))
#define OP_FMAX(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (b) > (a) ? (b) : (a))

/* out[j] = rows[0][j] op rows[1][j] op ... (k >= 1 rows of m elements).  Blocked: each block of
 * out is computed in a local accumulator from every row, then stored, so out may be any one of
 * the rows (a rank reduces in place, its own row read from its own tensor). */
#define KBLOCK 512
#define ROWS_KERNEL(fname, T, OP)                                                          \
    static void KNAME(fname)(void *out_, const void *const *rows_, int k, int64_t m) {    \
        T *out = (T *)out_;                                                               \
        const T *const *rows = (const T *const *)rows_;                                   \
        T acc[KBLOCK];                                                                    \
        for (int64_t b = 0; b < m; b += KBLOCK) {                                         \
            int64_t len = m - b < KBLOCK ? m - b : KBLOCK;                                \
            const T *r0 = rows[0] + b;                                                    \
            if (k == 1) {                                                                 \
                for (int64_t j = 0; j < len; j++) acc[j] = r0[j];                         \
            } else {                                                                      \
                const T *r1 = rows[1] + b;                                                \
                for (int64_t j = 0; j < len; j++) acc[j] = OP(r0[j], r1[j]);              \
            }                                                                             \
            for (int r = 2; r < k; r++) {                                                 \
                const T *rr = rows[r] + b;                                                \
                for (int64_t j = 0; j < len; j++) acc[j] = OP(acc[j], rr[j]);             \
            }                                                                             \
            for (int64_t j = 0; j < len; j++) out[b + j] = acc[j];                        \
        }                                                                                 \
    }

/* 16-bit floats: widened to float, one operation, rounded back (per step, as torch) */
#define ROWS_KERNEL16(fname, TO_F, FROM_F, OP)                                             \
    static void KNAME(fname)(void *out_, const void *const *rows_, int k, int64_t m) {    \
        uint16_t *out = (uint16_t *)out_;                                                 \
        const uint16_t *const *rows = (const uint16_t *const *)rows_;                     \
        uint16_t acc[KBLOCK];                                                             \
        for (int64_t b = 0; b < m; b += KBLOCK) {                                         \
            int64_t len = m - b < KBLOCK ? m - b : KBLOCK;                                \
            const uint16_t *r0 = rows[0] + b;                                             \
            if (k == 1) {                                                                 \
                for (int64_t j = 0; j < len; j++) acc[j] = r0[j];                         \
            } else {                                                                      \
                const uint16_t *r1 = rows[1] + b;                                         \
                for (int64_t j = 0; j < len; j++) acc[j] = FROM_F(OP(TO_F(r0[j]), TO_F(r1[j]))); \
            }                                                                             \
            for (int r = 2; r < k; r++) {                                                 \
                const uint16_t *rr = rows[r] + b;                                         \
                for (int64_t j = 0; j < len; j++) acc[j] = FROM_F(OP(TO_F(acc[j]), TO_F(rr[j]))); \
            }                                                                             \
            for (int64_t j = 0; j < len; j++) out[b + j] = acc[j];                        \
        }                                                                                 \
    }

ROWS_KERNEL(sum_f32, float, OP_SUM)
ROWS_KERNEL(sum_f64, double, OP_SUM)
ROWS_KERNEL(prod_f32, float, OP_PROD)
ROWS_KERNEL(prod_f64, double, OP_PROD)
ROWS_KERNEL(min_f32, float, OP_FMIN)
ROWS_KERNEL(min_f64, double, OP_FMIN)
ROWS_KERNEL(max_f32, float, OP_FMAX)
ROWS_KERNEL(max_f64, double, OP_FMAX)
ROWS_KERNEL(sum_u8, uint8_t, OP_SUM)
ROWS_KERNEL(sum_u16, uint16_t, OP_SUM)
ROWS_KERNEL(sum_u32, uint32_t, OP_SUM)
ROWS_KERNEL(sum_u64, uint64_t, OP_SUM)
ROWS_KERNEL(prod_u8, uint8_t, OP_PROD16)
ROWS_KERNEL(prod_u32, uint32_t, OP_PROD)
ROWS_KERNEL(prod_u64, uint64_t, OP_PROD)
ROWS_KERNEL(band_u8, uint8_t, OP_BAND)
ROWS_KERNEL(bor_u8, uint8_t, OP_BOR)
ROWS_KERNEL(bxor_u8, uint8_t, OP_BXOR)
ROWS_KERNEL(min_i8, int8_t, OP_IMIN)
ROWS_KERNEL(max_i8, int8_t, OP_IMAX)
ROWS_KERNEL(min_u8, uint8_t, OP_IMIN)
ROWS_KERNEL(max_u8, uint8_t, OP_IMAX)
ROWS_KERNEL(min_i16, int16_t, OP_IMIN)
ROWS_KERNEL(max_i16, int16_t, OP_IMAX)
ROWS_KERNEL(min_i32, int32_t, OP_IMIN)
ROWS_KERNEL(max_i32, int32_t, OP_IMAX)
ROWS_KERNEL(min_i64, int64_t, OP_IMIN)
ROWS_KERNEL(max_i64, int64_t, OP_IMAX)
ROWS_KERNEL16(sum_f16, f16_to_f32, f32_to_f16, OP_SUM)
ROWS_KERNEL16(sum_bf16, bf16_to_f32, f32_to_bf16, OP_SUM)
ROWS_KERNEL16(prod_f16, f16_to_f32, f32_to_f16, OP_PROD)
ROWS_KERNEL16(prod_bf16, bf16_to_f32, f32_to_bf16, OP_PROD)
ROWS_KERNEL16(min_f16, f16_to_f32, f32_to_f16, OP_FMIN)
ROWS_KERNEL16(max_f16, f16_to_f32, f32_to_f16, OP_FMAX)
ROWS_KERNEL16(min_bf16, bf16_to_f32, f32_to_bf16, OP_FMIN)
ROWS_KERNEL16(max_bf16, bf16_to_f32, f32_to_bf16, OP_FMAX)

ROWS_KERNEL(prod_u16, uint16_t, OP_PROD16)

/* the kernel of (op, dtype), or NULL: the table engine.c dispatches through */
static rows_fn KNAME(kernel)(int op, int dtype) {
#define K(f) KNAME(f)
    switch (op) {
    case OPC_SUM:
        switch (dtype) {
        case DT_F32: return K(sum_f32);
        case DT_F64: return K(sum_f64);
        case DT_F16: return K(sum_f16);
        case DT_BF16: return K(sum_bf16);
        case DT_I8: case DT_U8: return K(sum_u8);
        case DT_I16: return K(sum_u16);
        case DT_I32: return K(sum_u32);
        case DT_I64: return K(sum_u64);
        }
        break;
    case OPC_PROD:
        switch (dtype) {
        case DT_F32: return K(prod_f32);
        case DT_F64: return K(prod_f64);
        case DT_F16: return K(prod_f16);
        case DT_BF16: return K(prod_bf16);
        case DT_I8: case DT_U8: return K(prod_u8);
        case DT_I16: return K(prod_u16);
        case DT_I32: return K(prod_u32);
        case DT_I64: return K(prod_u64);
        }
        break;
    case OPC_MIN:
        switch (dtype) {
        case DT_F32: return K(min_f32);
        case DT_F64: return K(min_f64);
        case DT_F16: return K(min_f16);
        case DT_BF16: return K(min_bf16);
        case DT_I8: return K(min_i8);
        case DT_U8: return K(min_u8);
        case DT_I16: return K(min_i16);
        case DT_I32: return K(min_i32);
        case DT_I64: return K(min_i64);
        }
        break;
    case OPC_MAX:
        switch (dtype) {
        case DT_F32: return K(max_f32);
        case DT_F64: return K(max_f64);
        case DT_F16: return K(max_f16);
        case DT_BF16: return K(max_bf16);
        case DT_I8: return K(max_i8);
        case DT_U8: return K(max_u8);
        case DT_I16: return K(max_i16);
        case DT_I32: return K(max_i32);
        case DT_I64: return K(max_i64);
        }
        break;
    case OPC_BAND: case OPC_BOR: case OPC_BXOR:
        switch (dtype) {  /* bitwise: bytes of any integer width */
        case DT_I8: case DT_U8: case DT_I16: case DT_I32: case DT_I64:
            return op == OPC_BAND ? K(band_u8) : op == OPC_BOR ? K(bor_u8) : K(bxor_u8);
        }
        break;
    }
    return 0;
#undef K
}

#undef KNAME
#undef KBLOCK
#undef ROWS_KERNEL
#undef ROWS_KERNEL16
#undef OP_PROD16
