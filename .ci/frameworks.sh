#!/usr/bin/env bash
# The frameworks job: docs/frameworks.md's recipes -- plain torch, Hugging Face
# Trainer, accelerate, Lightning Trainer, Fabric -- on 2 ranks under torchrun and MPICH's
# mpiexec, and Lightning/Fabric as plain `python` (Lightning starts its ranks); each asserts
# backend shm, every rank on its own cores, the model DDP-wrapped, identical weights, falling
# loss.  Plus the no-DDP warning and the init-before-Lightning error (tests/test_frameworks.py),
# and FSDP under the frameworks (tests/test_shard_frameworks.py: Lightning's FSDP2 recipe).
#   bash .ci/frameworks.sh install   # venv "$CI_WORK/frameworks": torch==2.13.0, then -e ".[test,frameworks]"
#   bash .ci/frameworks.sh test      # needs CPUDDP_MPICH_MPIEXEC (source .ci/launchers.sh exports)
# How long, on a 2-vCPU AMD EPYC (Zen 4): the test about 2 minutes (30 tests); the install, in the
# background beside the others, about 1 minute from a warm wheel cache (longer without).  Each
# step prints its duration.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CI_WORK:?CI_WORK must be set (by .ci/run)}"
VENV="$CI_WORK/frameworks"

case "${1:-}" in
  install)
    start=$SECONDS
    python3 -m venv "$VENV"
    # torch first (the CPU build), so the frameworks' torch requirement is already met.
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q -e ".[test,frameworks]"
    "$VENV/bin/python" -c "import transformers, accelerate, lightning, torch; print('frameworks venv: torch', torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| lightning', lightning.__version__)"
    echo "install took $((SECONDS - start)) s"
    ;;
  test)
    start=$SECONDS
    : "${CPUDDP_MPICH_MPIEXEC:?source .ci/launchers.sh exports first}"
    CPUDDP_REQUIRE_FRAMEWORKS=1 CPUDDP_REQUIRE_LAUNCHERS=1 \
      "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_frameworks.py tests/test_shard_frameworks.py tests/test_ddp_check.py
    echo "frameworks test took $((SECONDS - start)) s"
    ;;
  *) echo "usage: bash .ci/frameworks.sh install | test" >&2; exit 2 ;;
esac
