#!/usr/bin/env bash
# The release wheels, built as docs/install.md says and used as a cluster user would use them:
#   bash .ci/wheels.sh install   # a tools venv (build, ziglang, auditwheel); the sdist and wheels
#                                # (tools/build_wheels.sh, glibc 2.17, x86_64 and aarch64) into
#                                # "$CI_WORK/wheels"; a fresh venv "$CI_WORK/wheelvenv" holding
#                                # torch==2.13.0 and the x86-64 wheel
#   bash .ci/wheels.sh test      # the checks below
# What it checks: each wheel is tagged py3-none-manylinux_2_17_<its library's machine>, auditwheel
# agrees, and its library needs no glibc symbol newer than 2.17 (read from its ELF by our own
# reader and by objdump); the sdist carries the C sources and no library; the venv holds no
# C compiler on its PATH (a directory of links to /usr/bin and /bin less every compiler), and
# there `cpuddp doctor` says `native (<the widest width this CPU has>)`, and README's main job
# runs with the native data path in its header.  The x86-64 library's avx2 and avx512 kernels are
# vector code (objdump); the aarch64 library is loaded and self-tested under qemu-aarch64
# (tests/native/load.c, built with Debian's cross compiler, which `.ci/native.sh install` installs).
# Measured on the project's 2-vCPU machine (AMD EPYC, AVX2), 2026-12-06, with other work loading it
# (load average 10): install 366 s (the tools 161 s, ziglang's wheel from pip's cache; both
# wheels 83 s; the venv 122 s), test 115 s (the quickstart's job 112 s of it, about 30 s unloaded).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CI_WORK:?CI_WORK must be set (by .ci/run)}"
TOOLS="$CI_WORK/wheeltools"
WHEELS="$CI_WORK/wheels"
VENV="$CI_WORK/wheelvenv"
REPO="$PWD"

nocc_path() {  # a directory of links to everything on /usr/bin and /bin but the C compilers
  local dir="$CI_WORK/nocc-bin" f name
  mkdir -p "$dir"
  for f in /usr/local/bin/* /usr/bin/* /bin/*; do
    name="${f##*/}"
    case "$name" in
      cc|c89|c99|gcc|gcc-*|*-gcc|*-gcc-*|clang|clang-*|*-clang|tcc|zig|icx|icc|ccache|cpp|cpp-*) continue ;;
    esac
    [ -e "$dir/$name" ] || ln -s "$f" "$dir/$name"
  done
  echo "$VENV/bin:$dir"
}

case "${1:-}" in
  install)
    start=$SECONDS
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q build ziglang auditwheel
    echo "tools installed in $((SECONDS - start)) s"
    PYTHON="$TOOLS/bin/python" bash tools/build_wheels.sh "$WHEELS"
    echo "wheels built at $((SECONDS - start)) s"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q "$WHEELS"/cpuddp-*_x86_64*.whl
    echo "install took $((SECONDS - start)) s"
    ;;
  test)
    start=$SECONDS
    ls -l "$WHEELS"
    "$TOOLS/bin/python" - "$WHEELS" <<'PY'
import glob, os, sys, tarfile, zipfile
sys.path.insert(0, "cpuddp/backends/shm/native")
import elf  # the reader setup.py tags the wheels with

where = sys.argv[1]
for arch in ("x86_64", "aarch64"):
    (wheel,) = glob.glob(os.path.join(where, f"cpuddp-*-py3-none-manylinux_2_17_{arch}.manylinux2014_{arch}.whl"))
    with zipfile.ZipFile(wheel) as z:
        needs = elf.read(z.read("cpuddp/backends/shm/native/libcpuddp_shm.so"))
        wheel_file = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
    assert needs.machine == arch, (wheel, needs.machine)
    assert elf.glibc_needed(needs) <= (2, 17), (wheel, needs.versions)
    assert set(needs.libraries) <= elf.SYSTEM_LIBS, (wheel, needs.libraries)
    assert "Root-Is-Purelib: false" in wheel_file, wheel_file
    print(f"{os.path.basename(wheel)}: {arch}, needs glibc {'.'.join(map(str, elf.glibc_needed(needs)))}, "
          f"{', '.join(needs.libraries)}")
(sdist,) = glob.glob(os.path.join(where, "cpuddp-*.tar.gz"))
names = tarfile.open(sdist).getnames()
for need in ("native/engine.c", "/setup.py", "/tools/cpuddp_build.py"):  # tools/: pyproject's build backend
    assert any(n.endswith(need) for n in names), (need, names)
assert not any(n.endswith(".so") or n.endswith(".build.json") for n in names), "the sdist carries a build"
print(f"{os.path.basename(sdist)}: the C sources, no library")
PY
    for wheel in "$WHEELS"/*.whl; do
      "$TOOLS/bin/auditwheel" show "$wheel" | tee "$CI_WORK/auditwheel.txt"
      grep -q '"manylinux_2_17_' "$CI_WORK/auditwheel.txt" || { echo "== auditwheel: not manylinux_2_17"; exit 1; }
      unzip -o -q "$wheel" 'cpuddp/backends/shm/native/libcpuddp_shm.so' -d "$CI_WORK/unzipped"
      newest=$(objdump -T "$CI_WORK/unzipped/cpuddp/backends/shm/native/libcpuddp_shm.so" \
               | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
      echo "objdump: the newest glibc symbol version it needs: $newest"
      [ "$(printf '%s\nGLIBC_2.17\n' "$newest" | sort -V | tail -1)" = GLIBC_2.17 ] || exit 1
    done
    a64="$CI_WORK/unzipped-aarch64"
    unzip -o -q "$WHEELS"/cpuddp-*_aarch64*.whl 'cpuddp/backends/shm/native/libcpuddp_shm.so' -d "$a64"
    bash .ci/native.sh install  # the cross compiler and qemu-user (phase 1 installed them)
    echo "-- the aarch64 wheel's library under qemu-aarch64, loaded and self-tested (tests/native/load.c)"
    aarch64-linux-gnu-gcc -O2 -std=c11 tests/native/load.c -ldl -o "$CI_WORK/load-aarch64"
    qemu-aarch64 -L /usr/aarch64-linux-gnu "$CI_WORK/load-aarch64" "$a64/cpuddp/backends/shm/native/libcpuddp_shm.so"
    echo "-- the x86-64 wheel's vector kernels: AVX2 and AVX-512 code (zig cc is clang)"
    x86="$CI_WORK/unzipped/cpuddp/backends/shm/native/libcpuddp_shm.so"
    unzip -o -q "$WHEELS"/cpuddp-*_x86_64*.whl 'cpuddp/backends/shm/native/libcpuddp_shm.so' -d "$CI_WORK/unzipped"
    objdump -d --no-show-raw-insn "$x86" > "$CI_WORK/x86.dis"
    vector() {  # vector KERNEL REGISTER: how many of KERNEL's instructions use REGISTER (ymm, zmm)
      awk -v k="<$1>:" -v r="$2" '$2 == k {p = 1; next} /^$/ {p = 0} p && index($0, r) {n++} END {print n + 0}' \
        "$CI_WORK/x86.dis"
    }
    for k in sum_f32 sum_bf16 max_f64; do
      echo "${k}_avx2: $(vector "${k}_avx2" ymm) ymm instructions; ${k}_avx512: $(vector "${k}_avx512" zmm) zmm"
      [ "$(vector "${k}_avx2" ymm)" -gt 0 ] && [ "$(vector "${k}_avx512" zmm)" -gt 0 ] \
        || { echo "== ${k}: a vector width without its vector code"; exit 1; }
    done
    PATH="$(nocc_path)"
    export PATH
    python -c "from cpuddp.backends.shm.native.build import find_compiler as f; c, why = f(); assert c is None, c; print(why)"
    cd "$CI_WORK"  # not the checkout: cpuddp is the wheel's
    python -c "import cpuddp, sys; assert cpuddp.__file__.startswith(sys.prefix), cpuddp.__file__; print(cpuddp.__file__)"
    cpuddp doctor | tee "$CI_WORK/wheel-doctor.txt"
    # native, at the widest width this CPU and its OS have (CPUID read by the library itself)
    want=$(python - <<'PY'
flags = set(next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split(":", 1)[1].split())
print("avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else "avx2" if "avx2" in flags else "scalar")
PY
)
    grep -q "native ($want" "$CI_WORK/wheel-doctor.txt" || { echo "== doctor does not say 'native ($want)'"; exit 1; }
    t0=$SECONDS
    python -m torch.distributed.run --nproc-per-node 2 "$REPO/examples/finetune.py" 2>&1 | tee "$CI_WORK/wheel-job.txt"
    grep -q "native data path" "$CI_WORK/wheel-job.txt" || { echo "== the job's header does not say native"; exit 1; }
    echo "README's job took $((SECONDS - t0)) s; test took $((SECONDS - start)) s"
    ;;
  *) echo "usage: bash .ci/wheels.sh install | test" >&2; exit 2 ;;
esac
