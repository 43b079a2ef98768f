/* A built library, loaded as the binding loads it (dlopen) and checked as the binding's self-test
 * checks it: its ABI, its digest, its fence (which the Python engine calls off x86) called once, and
 * at every width it runs here a float32 sum (NaN, 2^100 + 2^100) and a bfloat16 sum rounded to
 * nearest even -- for a library no Python can load here, such as a
 * wheel's aarch64 library under qemu-aarch64 (.ci/wheels.sh).  Built alone:
 *   cc -O2 -std=c11 tests/native/load.c -ldl -o load
 * Usage: load LIBRARY   (prints one line per width checked; exits 1 at the first wrong result) */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int (*reduce_rows_fn)(int, int, int, void *, const void *const *, int, int64_t);

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: load LIBRARY\n"); return 2; }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
    int (*abi)(void) = (int (*)(void))dlsym(lib, "cpuddp_shm_abi");
    const char *(*digest)(void) = (const char *(*)(void))dlsym(lib, "cpuddp_shm_digest");
    int (*supported)(int) = (int (*)(int))dlsym(lib, "cpuddp_shm_isa_supported");
    reduce_rows_fn reduce_rows = (reduce_rows_fn)dlsym(lib, "cpuddp_shm_reduce_rows");
    void (*fence)(void) = (void (*)(void))dlsym(lib, "cpuddp_shm_fence");
    if (!abi || !digest || !supported || !reduce_rows || !fence) {
        fprintf(stderr, "a function is missing\n");
        return 1;
    }
    fence();
    printf("abi %d, digest %s\n", abi(), digest());
    static const char *names[] = {"scalar", "avx2", "avx512"};
    for (int isa = 0; isa < 3; isa++) {
        if (!supported(isa)) continue;
        float a[5] = {1.5f, -2.0f, 3.25f, __builtin_nanf(""), 0x1p100f}, b[5] = {0.25f, 2.0f, -1.0f, 1.0f, 0x1p100f};
        float out[5];
        uint16_t h[2] = {0x3F80, 0x3F81}, hout[2];  /* bfloat16 1.0 and 1.0078125 */
        const void *rows[2] = {a, b}, *hrows[2] = {h, h};
        if (reduce_rows(isa, 0, 0, out, rows, 2, 5) || reduce_rows(isa, 0, 3, hout, hrows, 2, 2)) {
            printf("%s: refused a valid call\n", names[isa]);
            return 1;
        }
        int ok = out[0] == 1.75f && out[1] == 0.0f && out[2] == 2.25f && out[3] != out[3] && out[4] == 0x1p101f &&
                 hout[0] == 0x4000 && hout[1] == 0x4001;
        printf("%s: %s\n", names[isa], ok ? "ok" : "WRONG");
        if (!ok) return 1;
    }
    return 0;
}
