#!/usr/bin/env bash
# The shm engine's two data paths and its sanitizer builds, in the venv of phase 2
# (README's editable install, which built cpuddp/backends/shm/native/libcpuddp_shm.so):
#   bash .ci/native.sh test
# 1. the engine's tests on the Python path (CPUDDP_SHM_NATIVE=0) that no other phase runs there:
#    README's suite ran them on the native one, and the engine's other tests (tests/test_shm.py,
#    its agreement, collectives, lifecycle) run on the Python path in phase 4, on torch 2.8
#    (.ci/ipex.sh); tests/test_shm_careless.py runs each case on both paths in README's suite; of
#    tests/test_shm_native.py only the three cases that take whichever path loads run here (its
#    others name their path or test the library itself);
# 2. the native library built with -fsanitize=address,undefined (AddressSanitizer preloaded, with
#    libstdc++ so torch's C++ exceptions pass its interceptor), the native path required
#    (CPUDDP_SHM_NATIVE=1), for the native tests, the engine's fault and agreement tests and the
#    careless calls (tests/test_shm_careless.py, its native cases: README's suite ran both);
# 3. (tests/native/threads.c under ThreadSanitizer: README's suite runs it,
#    tests/test_shm_native.py::test_the_protocol_under_thread_sanitizer)
# 4. engine.c, threads.c and kernels.c built for aarch64 (Debian's cross compiler) and the last
#    two run under qemu-aarch64 (Debian's qemu-user): the protocol with ranks as threads, and the
#    scalar kernels' digests, which must equal x86-64's line for line (those are checked against
#    torch's bits by the suite); a multi-process run on a real aarch64 CPU is unverified: none is
#    at hand, and qemu runs the threads with x86's stronger memory ordering;
# then the library is built again as pip builds it (also when a step fails).
#   bash .ci/native.sh install   # Debian's aarch64 cross compiler and qemu-user (.ci/run's phase 1;
#                                # .ci/wheels.sh uses them too); nothing if they are present
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CI_WORK:?CI_WORK must be set (by .ci/run)}"
install_cross() {
  command -v aarch64-linux-gnu-gcc > /dev/null && command -v qemu-aarch64 > /dev/null && return 0
  local pkgs=(gcc-aarch64-linux-gnu qemu-user) apt=(apt-get -o DPkg::Lock::Timeout=300 -y -qq)
  # the lock timeout: Slurm's install (.ci/slurm.sh) may be running apt-get at the same moment
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" install "${pkgs[@]}" > /dev/null 2>&1 \
    || { apt-get -o DPkg::Lock::Timeout=300 update -qq \
         && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install "${pkgs[@]}" > /dev/null; }
}
case "${1:-}" in
  install) install_cross; exit 0 ;;
  test) ;;
  *) echo "usage: bash .ci/native.sh install|test" >&2; exit 2 ;;
esac
ENGINE=(tests/test_shm_faults.py tests/test_shm_scale.py
        tests/test_shm_native.py::test_dtypes_the_list_lacks_move_their_own_bytes_and_a_disagreement_is_named
        tests/test_shm_native.py::test_a_group_of_one_rank_gives_its_input_back
        tests/test_shm_native.py::test_a_work_the_caller_kept_is_never_reused_for_the_next_call)
SANITIZED=(tests/test_shm_native.py tests/test_shm_agree.py tests/test_shm_faults.py)
# The second user's attack on the store and /dev/shm is decided before either data path runs:
# README's suite runs it (about 40 s alone on 2 vCPUs), these steps leave it out.
ATTACK=--deselect=tests/test_shm_faults.py::test_another_local_user_can_make_a_job_fail_but_never_read_or_change_its_data
step() { echo "== native.sh [$((SECONDS))s] $*"; }

step "the engine's tests on the Python path"
CPUDDP_SHM_NATIVE=0 python -m pytest -q -p no:cacheprovider "${ENGINE[@]}" "$ATTACK"

rebuild() { python -m cpuddp.backends.shm.native.build > /dev/null; }
trap rebuild EXIT
step "AddressSanitizer + UndefinedBehaviorSanitizer build, the native path required"
python -m cpuddp.backends.shm.native.build --sanitize address,undefined
LD_PRELOAD="$(cc -print-file-name=libasan.so) $(cc -print-file-name=libstdc++.so)" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  CPUDDP_SHM_NATIVE=1 python -m pytest -q -p no:cacheprovider "${SANITIZED[@]}" "$ATTACK" \
  --deselect=tests/test_shm_native.py::test_the_protocol_under_thread_sanitizer  # a ThreadSanitizer build
LD_PRELOAD="$(cc -print-file-name=libasan.so) $(cc -print-file-name=libstdc++.so)" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  CPUDDP_SHM_NATIVE=1 python -m pytest -q -p no:cacheprovider tests/test_shm_careless.py -k "not python"

step "aarch64: the library, the threaded test and the kernels' digests build with the cross compiler"
install_cross  # installed in phase 1; here when this script runs alone
CC=aarch64-linux-gnu-gcc python -m cpuddp.backends.shm.native.build "$CI_WORK/libcpuddp_shm-aarch64.so"
file "$CI_WORK/libcpuddp_shm-aarch64.so" 2>/dev/null || true
A64=(aarch64-linux-gnu-gcc -O2 -std=c11 -pthread -ffp-contract=off -static -I cpuddp/backends/shm/native)
"${A64[@]}" tests/native/threads.c -o "$CI_WORK/threads-aarch64"
"${A64[@]}" tests/native/kernels.c -o "$CI_WORK/kernels-aarch64"
step "aarch64 under qemu: the protocol (4 ranks as threads), the scalar kernels' digests against x86-64's"
qemu-aarch64 "$CI_WORK/threads-aarch64" 4 100
cc -O2 -std=c11 -pthread -ffp-contract=off -I cpuddp/backends/shm/native tests/native/kernels.c -o "$CI_WORK/kernels-x86"
"$CI_WORK/kernels-x86" > "$CI_WORK/kernels-x86.txt"  # also: every vector width here = the scalar code
"$CI_WORK/kernels-x86" scalar > "$CI_WORK/kernels-x86-scalar.txt"
qemu-aarch64 "$CI_WORK/kernels-aarch64" scalar > "$CI_WORK/kernels-aarch64.txt"
diff "$CI_WORK/kernels-x86-scalar.txt" "$CI_WORK/kernels-aarch64.txt"
step "done"
