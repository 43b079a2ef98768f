#!/usr/bin/env bash
# The one many-core run for issue 36: how the shm backend scales on a node of 16 cores (not run by CI).
# Run from the repository root on a lent machine (python3 with torch 2.11, nothing installed):
#     bash benchmarks/device_scale.sh         (results under $OUT; about 8 minutes wall in total)
# OUT defaults to a fresh private directory (mktemp -d, mode 0700), named at the start and the end;
# OUT=dir picks another: it must be a real directory (not a symlink) of yours, or one this script
# can create, that nobody else can write -- in a sticky one such as /tmp the results go to a fresh
# private directory inside it (the shim for `packaging` below is put on PYTHONPATH from there).
# 1. benchmarks/scale.py: allreduce, reduce_scatter, all_gather, broadcast, barrier at N = 2,4,8,16,
#    shm vs gloo in the same ranks, 4K..16M x4, each N ranks x (16/N) threads (default pinning),
#    copy ceiling with all N ranks copying at once   (budget 330 s)
# 2. 2-rank bimodality: the same allreduce and broadcast sweep 6 times each, per-size spread
#    (max/min of the per-run times) -- before the fix 256K-1M sizes took 55-85 or 400-500 us  (budget 100 s)
# 3. the CPU cost of waiting 3 s for a late peer (benchmarks/wait_cost.py)  (budget 30 s); what one
#    4 KiB call costs at 8 and 16 ranks (benchmarks/call_cost.py)  (budget 2 x 40 s)
# 4. DDP samples/s, gloo vs shm, at 2 and 8 ranks (benchmarks/shm_ddp.py, short)  (budget 60 s)
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

echo "== 1. scale sweeps"
timeout 330 $PY benchmarks/scale.py --nproc 2,4,8,16 -b 4K -e 16M -f 4 -w 3 -n 10 --rounds 3 \
    --ceiling-size 64M --timeout 100 --out "$OUT/scale" > "$OUT/scale.txt" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s"; tail -60 "$OUT/scale.txt"

echo "== 2. 2-rank spread: first the hand-off probe (no cpuddp: do the cores stay put?), then allreduce, broadcast 6 runs each"
timeout 20 $PY benchmarks/handoff_probe.py --cpus 0,8 --blocks 10 --iters 200 --pause 0.3 --json "$OUT/bimodal/probe.json" 2>&1 | tail -3
for coll in allreduce broadcast; do
  for i in 1 2 3 4 5 6; do
    timeout 15 $PY -m cpuddp bench $coll --nproc 2 -b 4K -e 4M -f 4 -w 5 -n 30 --no-ceiling --no-check \
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

echo "== 3. waiting 3 s for a late peer"
timeout 40 $PY benchmarks/wait_cost.py --late 3 --repeats 2 | tee "$OUT/wait_cost.txt"
for n in 8 16; do
  timeout 40 $PY benchmarks/call_cost.py --nproc $n --calls 500 --repeats 3 | tee -a "$OUT/call_cost.txt"
done

echo "== 4. DDP, gloo vs shm, 2 and 8 ranks (if time is left)"
for n in 2 8; do
  left=$(( 500 - ($(date +%s) - start) ))
  [ "$left" -gt 40 ] || { echo "skipped N=$n: $left s left"; continue; }
  timeout $(( left - 10 )) $PY benchmarks/shm_ddp.py --nproc $n --backends gloo,shm --repeats 1 --steps 8 --warmup 2 \
      --out "$OUT/shm_ddp_$n.json" 2>&1 | tail -15 | tee "$OUT/shm_ddp_$n.txt"
done
echo "done in $(( $(date +%s) - start )) s; results in $OUT"
