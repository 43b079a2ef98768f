#!/bin/sh
# A launcher agent for the MPI tests (tests/mpi_netns.py): what ssh is to mpiexec on a cluster.
# mpiexec calls it as `netns_agent.sh [ssh options] HOST COMMAND...`; it runs COMMAND -- its words
# joined with spaces and read by sh, as ssh does (Hydra and PRRTE quote for that) -- inside the
# network namespace that plays HOST, under that host's own hostname (a UTS namespace of its own:
# Open MPI's daemons must see distinct hosts), on the host's own CPUs where the line names them
# (taskset).  $CPUDDP_TEST_HOSTS names a file of "ADDRESS NAMESPACE HOSTNAME [CPUS]" lines: the
# only hosts it enters.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
shift
line=$(awk -v h="$host" '$1 == h || $3 == h { print $2, $3, ($4 == "" ? "-" : $4); exit }' "$CPUDDP_TEST_HOSTS")
[ -n "$line" ] || { echo "netns_agent.sh: unknown host $host" >&2; exit 255; }
command=$*
set -- $line
if [ "$3" != "-" ]; then
  exec taskset -c "$3" ip netns exec "$1" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$2" "$command"
fi
exec ip netns exec "$1" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$2" "$command"
