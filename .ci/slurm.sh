#!/usr/bin/env bash
# A real Slurm for the tests (tests/test_slurm.py): Debian's slurmctld, slurmd, slurm-client and
# munge (22.05 on bookworm), plus iproute2 for the two-node cluster in network namespaces.
# (`srun --mpi=pmi2` needs no libpmi2-0: MPICH and Intel MPI speak PMI-2 to slurmstepd's plugin.)
# The tests start and stop the daemons themselves (no systemd).
#   bash .ci/slurm.sh install    # apt-get the packages (quiet; does nothing if they are present)
#   source .ci/slurm.sh exports  # make a missing Slurm fail the tests instead of skipping them
#   bash .ci/slurm.sh test       # nothing: the main pytest run executes tests/test_slurm.py
case "${1:-}" in
  install)
    set -euo pipefail
    missing=()
    for pkg in slurmctld slurmd slurm-client munge iproute2; do
      dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      # The lock timeout: another CI step may be running apt-get at the same moment.
      apt-get -o DPkg::Lock::Timeout=300 update -qq
      apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    ;;
  exports)
    export CPUDDP_REQUIRE_SLURM=1
    ;;
  test) : ;;
  *) echo "usage: bash .ci/slurm.sh install|test | source .ci/slurm.sh exports" >&2; exit 2 ;;
esac
