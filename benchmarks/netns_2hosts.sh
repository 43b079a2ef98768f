#!/usr/bin/env bash
# Two "hosts" of two ranks on one machine: network namespaces joined by a veth pair, and
# `cpuddp bench allreduce --backend gloo,shm` across them (shm's hierarchical path: shared
# memory within each namespace, gloo between them).  Needs root and iproute2.
#   sudo bash benchmarks/netns_2hosts.sh -b 1K -e 16M -f 4 --iters 10   # extra args go to cpuddp bench
# Prints rank 0's output; the other ranks' logs are in $OUT (default a temporary directory).
# Both namespaces share this machine's CPUs: a correctness and plumbing check, not a scaling one.
# NET shapes the veth link on both ends with tc (rate: tbf; one-way delay: netem, where the
# kernel has it -- this project's VM kernel has no netem, and the script says so):
#   NET=10g (10 Gbit/s, 25 us)  NET=25g (25 Gbit/s, 15 us)  NET=1g (1 Gbit/s, 50 us)  NET=none
#   sudo NET=10g flock "$(python benchmarks/_heavy_lock.py)" bash benchmarks/netns_2hosts.sh -b 16M -e 16M --iters 10
# DDP samples/s over the same shaped links: benchmarks/netns_ddp.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d -t cpuddp-2hosts.XXXXXX)}
A=cpuddp2h-a; B=cpuddp2h-b
cleanup() { ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add "$A"; ip netns add "$B"
ip link add cpuddp2ha netns "$A" type veth peer name cpuddp2hb netns "$B"
ip -n "$A" addr add 10.77.0.1/24 dev cpuddp2ha; ip -n "$B" addr add 10.77.0.2/24 dev cpuddp2hb
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set cpuddp2ha up; ip -n "$B" link set cpuddp2hb up
shape() {  # namespace interface rate delay_us
  ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null || true
  if ip netns exec "$1" tc qdisc add dev "$2" root handle 1: netem delay "$4us" limit 100000 2>/dev/null; then
    ip netns exec "$1" tc qdisc add dev "$2" parent 1:1 handle 10: tbf rate "$3" burst 4mb latency 10ms
  else
    echo "# $1: no netem in this kernel: rate $3 only, no added delay" >&2
    ip netns exec "$1" tc qdisc add dev "$2" root handle 10: tbf rate "$3" burst 4mb latency 10ms
  fi
}
case "${NET:-none}" in
  none) ;;
  10g) shape "$A" cpuddp2ha 10gbit 25; shape "$B" cpuddp2hb 10gbit 25 ;;
  25g) shape "$A" cpuddp2ha 25gbit 15; shape "$B" cpuddp2hb 25gbit 15 ;;
  1g)  shape "$A" cpuddp2ha 1gbit 50;  shape "$B" cpuddp2hb 1gbit 50 ;;
  *) echo "NET=$NET: use none, 10g, 25g or 1g" >&2; exit 2 ;;
esac
pids=()
for r in 0 1 2 3; do
  ns=$A; [ "$r" -ge 2 ] && ns=$B
  ip netns exec "$ns" env RANK="$r" WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 \
    MASTER_ADDR=10.77.0.1 MASTER_PORT=29555 \
    timeout 600 "$PYTHON" -m cpuddp bench allreduce --backend gloo,shm "$@" > "$OUT/rank$r.log" 2>&1 &
  pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
cat "$OUT/rank0.log"
[ "$rc" = 0 ] || { echo "a rank failed; logs in $OUT" >&2; tail -n 5 "$OUT"/rank*.log >&2; }
exit "$rc"
