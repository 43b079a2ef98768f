#!/usr/bin/env bash
# cpuddp's release files: the sdist, and one wheel per platform whose native library is linked
# against glibc 2.17 (zig's C compiler, from PyPI's ziglang, targets any glibc from any Linux):
#   pip install build ziglang
#   bash tools/build_wheels.sh [OUT]        # default OUT: dist/
# gives OUT/cpuddp-V.tar.gz, cpuddp-V-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl and
# the same for aarch64.  Each wheel's tag is read from the library built (setup.py: its machine,
# the newest glibc symbol it needs), so it never claims an older glibc than it needs; a wheel
# that comes out without its library (tagged py3-none-any) fails this script with the compiler's
# first error line.  The wheels are built from the sdist, as pip would build it.
# PYTHON: the Python with build and ziglang (default: python3 on PATH).  TARGETS: the platforms
# (default "x86_64 aarch64"); GLIBC: the glibc the libraries are linked against (default 2.17).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${1:-dist}")"
PY="$(command -v "${PYTHON:-python3}")"
TARGETS="${TARGETS:-x86_64 aarch64}"
GLIBC="${GLIBC:-2.17}"
"$PY" -c "import build, ziglang" 2>/dev/null \
  || { echo "build_wheels.sh: $PY lacks build or ziglang: $PY -m pip install build ziglang" >&2; exit 2; }
mkdir -p "$OUT"
WORK="$(mktemp -d -t cpuddp-wheels.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

"$PY" -m build --sdist --outdir "$WORK" . > "$WORK/sdist.log" 2>&1 || { cat "$WORK/sdist.log"; exit 1; }
sdist="$(ls "$WORK"/cpuddp-*.tar.gz)"
tar -xzf "$sdist" -C "$WORK"
cp "$sdist" "$OUT/"
echo "sdist: $OUT/$(basename "$sdist")"
for arch in $TARGETS; do
  start=$SECONDS
  CC="$(printf %q "$PY") -m ziglang cc -target $arch-linux-gnu.$GLIBC" \
    "$PY" -m build --wheel --outdir "$WORK/$arch" "$WORK/$(basename "$sdist" .tar.gz)" > "$WORK/$arch.log" 2>&1 \
    || { cat "$WORK/$arch.log"; exit 1; }
  wheel="$(ls "$WORK/$arch"/*.whl)"
  case "$wheel" in
    *-any.whl) echo "build_wheels.sh: the $arch wheel has no native library:" >&2
               grep "native library was not built" "$WORK/$arch.log" >&2; exit 1 ;;
  esac
  cp "$wheel" "$OUT/"
  echo "$arch: $OUT/$(basename "$wheel") ($((SECONDS - start)) s)"
done
