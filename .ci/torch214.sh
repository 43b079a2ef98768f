#!/usr/bin/env bash
# The newest torch CI's package index serves, torch 2.14.1, beside the suite's 2.13 (.ci/run
# phase 2) and 2.8 + IPEX (.ci/ipex.sh): what differs between torch releases, in a venv of its own.
#   bash .ci/torch214.sh install   # fresh venv "$CI_WORK/torch214": torch==2.14.1, then -e ".[test,bench]"
#   bash .ci/torch214.sh test      # the version-sensitive tests (below); needs .ci/launchers.sh exports
# What runs: the tests that differ between torch releases, listed once in .ci/version_tests.txt
# (the engine and its torch hooks, forming the group, sharding, checkpoints, prepare, the torch
# range), as on torch 2.8 + IPEX.  Not the whole suite: the rest does not touch what changes
# between torch releases, and runs on 2.13.  The frameworks' adoption stays on 2.13
# (.ci/frameworks.sh): their pins (transformers, accelerate, lightning) are tested there.
# PyPI's torch 2.14.1 is the CUDA build (nvidia-* wheels, cuda-toolkit): the venv is 5.6 GB.
# How long, on a 2-vCPU AMD EPYC (Zen 3, AVX2) with other work beside it: the install about 4
# minutes (torch from a warm wheel store, then the extras); the test: .ci/run's header.  Each step
# prints its duration.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CI_WORK:?CI_WORK must be set (by .ci/run)}"
VENV="$CI_WORK/torch214"
TORCH=2.14.1

case "${1:-}" in
  install)
    start=$SECONDS
    python3 -m venv "$VENV"
    # The constraint keeps torch at 2.14.1 through the later pip call (the extras, cpuddp itself).
    echo "torch==$TORCH" > "$VENV/torch-constraint.txt"
    export PIP_CONSTRAINT="$VENV/torch-constraint.txt"
    "$VENV/bin/pip" install -q "torch==$TORCH"
    echo "torch install took $((SECONDS - start)) s"
    "$VENV/bin/pip" install -q -e ".[test,bench]"
    "$VENV/bin/python" - "$TORCH" <<'EOF'
import importlib.metadata as md, sys
torch = md.version("torch")
assert torch.split("+")[0] == sys.argv[1], f"pip changed torch to {torch}"
print(f"torch {torch}")
EOF
    echo "install took $((SECONDS - start)) s; venv $(du -sh "$VENV" | cut -f1)"
    ;;
  test)
    start=$SECONDS
    : "${CPUDDP_MPICH_MPIEXEC:?source .ci/launchers.sh exports first}"
    mapfile -t TESTS < <(grep -v '^#' .ci/version_tests.txt | grep .)  # what differs between torch releases
    CPUDDP_REQUIRE_LAUNCHERS=1 "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}"
    echo "torch $TORCH test took $((SECONDS - start)) s"
    ;;
  *) echo "usage: bash .ci/torch214.sh install | test" >&2; exit 2 ;;
esac
