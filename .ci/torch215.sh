#!/usr/bin/env bash
# The newest torch, torch 2.15.0, beside the suite's 2.13 (.ci/run phase 2) and 2.8 + IPEX
# (.ci/ipex.sh): what differs between torch releases, in a venv of its own.
#   bash .ci/torch215.sh install   # fresh venv "$CI_WORK/torch215": torch==2.15.0, then -e ".[test,bench]"
#   bash .ci/torch215.sh test      # the version-sensitive tests (below); needs .ci/launchers.sh exports
# What runs: the tests that differ between torch releases, listed once in .ci/version_tests.txt
# (the engine and its torch hooks, forming the group, sharding, checkpoints, prepare, the torch
# range), as on torch 2.8 + IPEX.  Not the whole suite: the rest does not touch what changes
# between torch releases, and runs on 2.13.  The frameworks' adoption stays on 2.13
# (.ci/frameworks.sh): their pins (transformers, accelerate, lightning) are tested there.
# torch 2.15 needs Python >= 3.11.  A global pip constraints file may cap torch lower (this CI
# machine's caps it at 2.14.1): the venv's own PIP_CONSTRAINT, which replaces it, pins 2.15.0.
# PyPI's torch 2.15.0 is the CUDA build (nvidia-* wheels): the venv is about 6 GB.
# torch 2.14.1 is no longer run: 2.13 (the whole suite) and 2.15 (these tests) stand on either
# side of it, and a third CUDA venv would take CI past 45 minutes.
# How long, on a 2-vCPU AMD EPYC (Zen 3, AVX2) with other work beside it: the install about 5
# minutes from a warm wheel store (torch, then the extras), in phase 1's background; the test:
# .ci/run's header.  Each step prints its duration.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CI_WORK:?CI_WORK must be set (by .ci/run)}"
VENV="$CI_WORK/torch215"
TORCH=2.15.0

case "${1:-}" in
  install)
    start=$SECONDS
    python3 -c 'import sys; assert sys.version_info >= (3, 11), f"torch 2.15 needs Python >= 3.11, not {sys.version}"'
    python3 -m venv "$VENV"
    # The venv's own constraint keeps torch at 2.15.0 through both pip calls (the extras, cpuddp
    # itself), and replaces a global one that caps torch lower.
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
    mapfile -t TESTS < <(bash .ci/version_tests.sh paths)  # what differs between torch releases
    mapfile -t DESELECT < <(bash .ci/version_tests.sh deselect)
    CPUDDP_REQUIRE_LAUNCHERS=1 "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" "${DESELECT[@]}"
    echo "torch $TORCH test took $((SECONDS - start)) s"
    ;;
  *) echo "usage: bash .ci/torch215.sh install | test" >&2; exit 2 ;;
esac
