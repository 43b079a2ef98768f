#!/usr/bin/env bash
# A many-core run: how the shm backend scales on a node of 16 cores, and what the native data path
# does there (not run by CI).  Run from the repository root on a machine with python3 and torch
# (e.g. 2.11) and nothing else installed, with the native library built elsewhere and copied
# along (cpuddp/backends/shm/native/libcpuddp_shm.so: plain C, no Python tag; without it the
# Python path runs, and line 0 says so):
#     bash benchmarks/device_scale.sh         (results under $OUT; under 5 minutes wall in total)
# OUT defaults to a fresh private directory (mktemp -d, mode 0700), named at the start and the end;
# OUT=dir picks another: it must be a real directory (not a symlink) of yours, or one this script
# can create, that nobody else can write -- in a sticky one such as /tmp the results go to a fresh
# private directory inside it (the shim for `packaging` below is put on PYTHONPATH from there).
# 0. the machine, and the shm data path a group would take (native (avx512) / python (why))
# 1. what one 4 KiB all_reduce and barrier cost at 2, 8 and 16 ranks, native and Python paths in one
#    run each (benchmarks/call_cost.py, pinned one CPU per rank)      (budget 3 x 30 s)
# 2. 16 MiB all_reduce, shm vs gloo, at 4x4, 8x2 and 16x1 ranks x threads, and the copy ceiling
#    with all ranks copying at once (benchmarks/scale.py)              (budget 75 s)
# 3. the 2-rank spread: allreduce and broadcast 4K..4M, 4 runs each, max/min per size (budget 45 s)
# 4. DDP at 8 ranks (gloo, shm) and shard.py at 8 ranks (ddp, shard-full, shard-optimizer)
#    (budget: what is left of 290 s)
set -u
if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d -t cpuddp-device-scale.XXXXXX) || { echo "mktemp -d failed" >&2; exit 1; }
else
  [ -L "$OUT" ] && { echo "OUT=$OUT is a symlink: refused" >&2; exit 1; }
  [ -e "$OUT" ] || mkdir -p -m 700 -- "$OUT" || exit 1
  if [ -L "$OUT" ] || [ ! -d "$OUT" ] || [ ! -O "$OUT" ]; then
    echo "OUT=$OUT is not a directory owned by $(id -un): refused" >&2; exit 1
  fi
  mode=8#$(stat -c %a -- "$OUT") || exit 1
  if (( mode & 8#022 )); then  # others can write there: only a sticky one (like /tmp) is usable,
    (( mode & 8#1000 )) || { echo "OUT=$OUT is writable by other users (chmod go-w, or leave OUT unset): refused" >&2; exit 1; }
    OUT=$(mktemp -d "$OUT/cpuddp-device-scale.XXXXXX") || exit 1  # and then a private directory in it
  fi
  OUT=$(cd -- "$OUT" && pwd -P) || exit 1  # absolute: it goes on PYTHONPATH
fi
echo "results in $OUT"
mkdir -p "$OUT/scale" "$OUT/bimodal"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=python3
# cpuddp needs `packaging` (psutil and py-cpuinfo are optional); a bare torch install may lack it,
# and torch ships its own copy: hand that on under the usual name (nothing is installed)
# (the shim is in $OUT, private to this user: never a shared directory on PYTHONPATH)
if ! $PY -c "import packaging.version" 2>/dev/null; then
  mkdir -p "$OUT/shim/packaging"
  echo "from torch._vendor.packaging import *" > "$OUT/shim/packaging/__init__.py"
  echo "from torch._vendor.packaging.version import *  # noqa" > "$OUT/shim/packaging/version.py"
  echo "from torch._vendor.packaging.version import InvalidVersion, Version  # noqa" >> "$OUT/shim/packaging/version.py"
  export PYTHONPATH=$PYTHONPATH:$OUT/shim
  echo "packaging: torch's vendored copy (no packaging installed)"
fi
start=$(date +%s)
{ $PY -c "import torch, cpuddp, sys; print('torch', torch.__version__, 'cpuddp', cpuddp.__file__, 'python', sys.version.split()[0])"
  nproc; lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L3'; git log --oneline -1; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

$PY -c "from cpuddp.backends.shm import native; print('0. shm data path:', native.status()[1])" 2>&1 | tee -a "$OUT/machine.txt"

echo "== 1. call cost, 4 KiB, both data paths"
for n in 2 8 16; do
  timeout 30 $PY benchmarks/call_cost.py --nproc $n --calls 500 --repeats 3 --kinds all_reduce,barrier \
      | tee -a "$OUT/call_cost.txt"
done
echo "after $(( $(date +%s) - start )) s"

echo "== 2. 16 MiB all_reduce at 4x4, 8x2, 16x1, shm vs gloo, and the copy ceiling"
timeout 75 $PY benchmarks/scale.py --nproc 4,8,16 --collectives allreduce -b 16M -e 16M -w 2 -n 6 --rounds 2 \
    --ceiling-size 64M --timeout 25 --out "$OUT/scale" > "$OUT/scale.txt" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s"; tail -25 "$OUT/scale.txt"

echo "== 3. 2-rank spread: allreduce, broadcast 4 runs each"
for coll in allreduce broadcast; do
  for i in 1 2 3 4; do
    timeout 10 $PY -m cpuddp bench $coll --nproc 2 -b 4K -e 4M -f 4 -w 5 -n 30 --no-ceiling --no-check \
        --json "$OUT/bimodal/${coll}_$i.json" > /dev/null 2>> "$OUT/bimodal/stderr.txt"
  done
done
$PY - "$OUT/bimodal" <<'PYEOF' | tee "$OUT/bimodal.txt"
import glob, json, sys, collections
for coll in ("allreduce", "broadcast"):
    t = collections.defaultdict(list)
    for f in sorted(glob.glob(f"{sys.argv[1]}/{coll}_*.json")):
        for r in json.load(open(f))["rows"]:
            t[r["size"]].append(r["time_us"])
    print(f"{coll}: size  runs  min_us  median_us  max_us  max/min")
    for s in sorted(t):
        v = sorted(t[s]); print(f"  {s:>8d}  {len(v):3d}  {v[0]:8.1f}  {v[len(v)//2]:8.1f}  {v[-1]:8.1f}  {v[-1]/v[0]:5.2f}")
PYEOF
echo "after $(( $(date +%s) - start )) s"

echo "== 4. DDP and shard.py at 8 ranks (what time is left of 290 s)"
left=$(( 290 - ($(date +%s) - start) ))
if [ "$left" -gt 40 ]; then
  timeout $(( left / 2 )) $PY benchmarks/shm_ddp.py --nproc 8 --backends gloo,shm,shm:4 --repeats 1 --steps 8 --warmup 2 \
      --out "$OUT/shm_ddp_8.json" 2>&1 | tail -8 | tee "$OUT/shm_ddp_8.txt"
  left=$(( 290 - ($(date +%s) - start) ))
  [ "$left" -gt 20 ] && timeout "$left" $PY benchmarks/shard.py --nproc 8 --cases ddp-gloo,ddp,shard-full,shard-optimizer \
      --models mlp --precisions fp32 --repeats 1 --steps 8 --warmup 2 --out "$OUT/shard_8.json" 2>&1 | tail -12 \
      | tee "$OUT/shard_8.txt"
else
  echo "skipped: $left s left"
fi
echo "done in $(( $(date +%s) - start )) s; results in $OUT"
