#!/usr/bin/env bash
# The other end of the supported torch range: torch 2.8.0 with intel-extension-for-pytorch 2.8.0
# (IPEX's last release, which imports only beside torch 2.8.*), in a venv of its own.
#   bash .ci/ipex.sh install   # fresh venv "$CI_WORK/ipex": torch 2.8.0, IPEX 2.8.0, cpuddp[test,bench,mpi]
#   bash .ci/ipex.sh test      # the version-sensitive tests in it; the IPEX tests must run, not skip
# PyPI's torch 2.8.0 is the CUDA build: with its nvidia-* dependencies the download is 3.8 GB and
# the venv 6.9 GB; the install takes 6-8 minutes on a 2-vCPU AMD EPYC (Zen 3, AVX2) and prints its
# own "install took" line.  Nothing is cached between CI runs; .ci/run starts this step in the
# background beside the others.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CI_WORK:?CI_WORK must be set (by .ci/run)}"
VENV="$CI_WORK/ipex"
TORCH=2.8.0
IPEX=2.8.0

case "${1:-}" in
  install)
    start=$SECONDS
    python3 -m venv "$VENV"
    # The constraint keeps torch at 2.8.0 through every later pip call (the test extras,
    # cpuddp itself): pip must never upgrade it to a torch IPEX cannot import beside.
    echo "torch==$TORCH" > "$VENV/torch-constraint.txt"
    export PIP_CONSTRAINT="$VENV/torch-constraint.txt"
    # Download first, into a folder of its own, so that its size is what this step fetched.
    wheels="$CI_WORK/ipex-wheels"
    "$VENV/bin/pip" download -q -d "$wheels" "torch==$TORCH" "intel-extension-for-pytorch==$IPEX"
    downloaded=$(du -sh "$wheels" | cut -f1)
    "$VENV/bin/pip" install -q --no-index --find-links "$wheels" "torch==$TORCH" "intel-extension-for-pytorch==$IPEX"
    rm -rf "$wheels"
    # mpi4py (a binary wheel) with MPICH's libmpi from PyPI in this venv itself; the frameworks and
    # minimal venvs have no mpi4py, so both ways are tested.
    "$VENV/bin/pip" install -q -e ".[test,bench,mpi]" mpich
    "$VENV/bin/python" - "$TORCH" "$IPEX" <<'EOF'
import importlib.metadata as md, sys
torch, ipex = md.version("torch"), md.version("intel-extension-for-pytorch")
assert torch.split("+")[0] == sys.argv[1], f"pip changed torch to {torch}"
assert ipex.split("+")[0] == sys.argv[2], f"pip installed IPEX {ipex}"
print(f"torch {torch}, intel-extension-for-pytorch {ipex}")
EOF
    echo "install took $((SECONDS - start)) s; downloaded $downloaded; venv $(du -sh "$VENV" | cut -f1)"
    ;;
  test)
    # CPUDDP_REQUIRE_IPEX=1 turns "IPEX not usable here" skips into failures (tests/test_ipex.py).
    # The tests that differ between torch releases (.ci/version_tests.txt); the whole suite runs
    # on torch 2.13 (.ci/run's phase 2): twice did not fit CI's time on 2 vCPUs.  On the shm
    # engine's Python data path (CPUDDP_SHM_NATIVE=0), whose steps are torch ops and meet the
    # oldest torch here (torch 2.15, phase 6, runs the native path); the native library's own
    # tests natively (one library for every torch).
    start=$SECONDS
    mapfile -t TESTS < <(bash .ci/version_tests.sh paths)
    mapfile -t DESELECT < <(bash .ci/version_tests.sh deselect)
    CPUDDP_REQUIRE_IPEX=1 CPUDDP_SHM_NATIVE=0 "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider \
      "${TESTS[@]}" "${DESELECT[@]}" --deselect=tests/test_shm_native.py
    "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider tests/test_shm_native.py "${DESELECT[@]}"
    echo "torch $TORCH + IPEX test took $((SECONDS - start)) s"
    ;;
  *) echo "usage: .ci/ipex.sh install|test" >&2; exit 2 ;;
esac
