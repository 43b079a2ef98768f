#!/usr/bin/env bash
# The shm engine's two data paths and its sanitizer builds (issue 44), in the venv of phase 2
# (README's editable install, which built cpuddp/backends/shm/native/libcpuddp_shm.so):
#   bash .ci/native.sh test
# 1. the engine's tests on the Python path (CPUDDP_SHM_NATIVE=0): README's suite ran them on the
#    native one;
# 2. the native library built with -fsanitize=address,undefined (AddressSanitizer preloaded, with
#    libstdc++ so torch's C++ exceptions pass its interceptor), the native path required
#    (CPUDDP_SHM_NATIVE=1), for the native tests and the engine's fault and agreement tests;
# 3. tests/native/threads.c -- ranks as threads over one segment, every collective -- under
#    ThreadSanitizer;
# 4. engine.c and threads.c built for aarch64 (Debian's cross compiler): the native path must
#    build there (its multi-process run on such a CPU is unverified: none is at hand);
# then the library is built again as pip builds it (also when a step fails).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = test ] || { echo "usage: bash .ci/native.sh test" >&2; exit 2; }
: "${CI_WORK:?CI_WORK must be set (by .ci/run)}"
ENGINE=(tests/test_shm.py tests/test_shm_agree.py tests/test_shm_collectives.py tests/test_shm_faults.py
        tests/test_shm_lifecycle.py tests/test_shm_scale.py tests/test_shm_native.py)
SANITIZED=(tests/test_shm_native.py tests/test_shm_agree.py tests/test_shm_faults.py)
step() { echo "== native.sh [$((SECONDS))s] $*"; }

step "the engine's tests on the Python path"
CPUDDP_SHM_NATIVE=0 python -m pytest -q -p no:cacheprovider "${ENGINE[@]}"

rebuild() { python -m cpuddp.backends.shm.native.build > /dev/null; }
trap rebuild EXIT
step "AddressSanitizer + UndefinedBehaviorSanitizer build, the native path required"
python -m cpuddp.backends.shm.native.build --sanitize address,undefined
LD_PRELOAD="$(cc -print-file-name=libasan.so) $(cc -print-file-name=libstdc++.so)" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  CPUDDP_SHM_NATIVE=1 python -m pytest -q -p no:cacheprovider "${SANITIZED[@]}"

step "ThreadSanitizer: tests/native/threads.c, 4 ranks as threads"
cc -fsanitize=thread -O1 -g -pthread -std=c11 -ffp-contract=off -I cpuddp/backends/shm/native \
  tests/native/threads.c -o "$CI_WORK/threads-tsan"
TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$CI_WORK/threads-tsan" 4 300

step "aarch64: the library and the threaded test build with the cross compiler"
if ! command -v aarch64-linux-gnu-gcc > /dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu > "$CI_WORK/aarch64-install.log" 2>&1 \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu \
         > "$CI_WORK/aarch64-install.log" 2>&1; } || { cat "$CI_WORK/aarch64-install.log"; exit 1; }
fi
CC=aarch64-linux-gnu-gcc python -m cpuddp.backends.shm.native.build "$CI_WORK/libcpuddp_shm-aarch64.so"
file "$CI_WORK/libcpuddp_shm-aarch64.so" 2>/dev/null || true
aarch64-linux-gnu-gcc -O2 -std=c11 -pthread -I cpuddp/backends/shm/native tests/native/threads.c \
  -o "$CI_WORK/threads-aarch64"
step "done"
