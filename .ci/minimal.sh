#!/usr/bin/env bash
# The minimal install: what README's Quickstart gives a new user -- torch and cpuddp, no extras,
# so no numpy, matplotlib, transformers, mpi4py, IPEX or pytest.
#   bash .ci/minimal.sh install   # fresh venv "$CI_WORK/minimal": pip install torch==2.13.0 && pip install .
#   bash .ci/minimal.sh test      # README's main command, then the minimal-install subset (tests/minimal/)
# The subset: README's `cpuddp run` line, 2-rank init + prepare + DDP steps under torchrun,
# prepare(shard="full") and shard="optimizer" with a checkpoint saved and resumed under torchrun,
# `cpuddp bench allreduce --nproc 2`
# (no plot), `cpuddp doctor`, `cpuddp.testing.run_distributed`.  A command that fails, or any
# output naming ImportError/ModuleNotFoundError (even one a command caught), fails the job.
# How long, on a 2-vCPU AMD EPYC (AVX2): the install about 2 minutes (in the background, beside
# the other installs), the test about 1.5 minutes; each step prints its duration.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CI_WORK:?CI_WORK must be set (by .ci/run)}"
VENV="$CI_WORK/minimal"
LOGS="$CI_WORK/minimal-logs"
# What the minimal install must not contain: each is an extra or an optional feature.
OPTIONAL="numpy matplotlib transformers mpi4py intel_extension_for_pytorch oneccl_bindings_for_pytorch pytest"

case "${1:-}" in
  install)
    start=$SECONDS
    python3 -m venv "$VENV"
    # README's install, verbatim, except `.` for `-e .`: CI tests the package as pip builds it.
    (
      # shellcheck disable=SC1091
      source "$VENV/bin/activate"
      pip install -q torch==2.13.0 && pip install -q .
    )
    "$VENV/bin/python" - $OPTIONAL <<'PY'
import importlib.util, sys
present = [name for name in sys.argv[1:] if importlib.util.find_spec(name) is not None]
if present:
    sys.exit(f"the minimal venv must not contain {present}: something pulled in an optional package")
print("minimal venv: torch and cpuddp only (" + ", ".join(sys.argv[1:]) + ": not installed)")
PY
    echo "install took $((SECONDS - start)) s"
    ;;
  test)
    start=$SECONDS
    mkdir -p "$LOGS"
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
    run() {  # run NAME COMMAND...: show its output; fail on a non-zero exit or an import error
      local name=$1; shift
      local t0=$SECONDS
      echo "-- $name: $*"
      if ! "$@" > "$LOGS/$name.log" 2>&1; then
        cat "$LOGS/$name.log"; echo "== minimal: '$name' failed"; exit 1
      fi
      cat "$LOGS/$name.log"
      if grep -nE "ImportError|ModuleNotFoundError" "$LOGS/$name.log"; then
        echo "== minimal: '$name' hit an import error (lines above)"; exit 1
      fi
      echo "-- $name: ok ($((SECONDS - t0)) s)"
    }
    # README's main command in its default configuration, plus --result-json to check the accuracy.
    run readme python -m torch.distributed.run --nproc-per-node 2 examples/finetune.py --bf16 \
      --result-json "$LOGS/finetune.json"
    python - "$LOGS/finetune.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if not r["accuracy"] >= 0.90:
    sys.exit(f"README promises held-out accuracy >= 0.90; this run got {r['accuracy']:.3f}")
print(f"accuracy {r['accuracy']:.3f}, {r['wall_seconds']:.0f} s in the script, precision {r['precision']}")
PY
    # README's way to launch, `cpuddp run`, on the same bare install
    run cpuddp_run cpuddp run --ranks-per-node 2 examples/finetune.py --bf16 --result-json "$LOGS/run.json"
    python - "$LOGS/run.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if not r["accuracy"] >= 0.90:
    sys.exit(f"cpuddp run: README promises held-out accuracy >= 0.90; this run got {r['accuracy']:.3f}")
print(f"cpuddp run: accuracy {r['accuracy']:.3f}, {r['wall_seconds']:.0f} s in the script")
PY
    run train_two_ranks python -m torch.distributed.run --nproc-per-node 2 tests/minimal/train_two_ranks.py
    # prepare(shard=...) and a checkpoint saved and resumed, with no numpy (torch's object collectives need it)
    for mode in full optimizer; do
      run "shard_$mode" python -m torch.distributed.run --nproc-per-node 2 tests/minimal/shard_two_ranks.py \
        "$mode" "$CI_WORK/minimal-ckpt-$mode"
    done
    run bench cpuddp bench allreduce --nproc 2 -b 1K -e 1M --timeout 120
    run doctor cpuddp doctor
    # `pip install .` built the shm engine's native library (this machine has a C compiler)
    grep -q "shm: .*data path native (" "$LOGS/doctor.log" || { echo "== minimal: no native shm data path"; exit 1; }
    run doctor_json sh -c 'cpuddp doctor --json | python -c "import json, sys; json.load(sys.stdin)"'
    run run_distributed python tests/minimal/run_distributed_check.py
    deactivate
    echo "minimal-install test took $((SECONDS - start)) s"
    ;;
  *) echo "usage: .ci/minimal.sh install|test" >&2; exit 2 ;;
esac
