"""The rule behind ``backend="auto"``: one pure function over plain facts.

:func:`auto_rule` is the only place the choice is made: :func:`cpuddp.backends.resolve_backend`
gathers the facts (the node layout, which backends work) and asks it, ``cpuddp doctor`` (with
and without ``--torch``) asks it through ``resolve_backend``, and :data:`RULE` is the rule in
words for the docs and messages.  The rule, for CPU tensors:

1. Ranks that share a node all-reduce through shared memory (``shm``) when the node is
   eligible (:func:`cpuddp.backends.shm.protocol.check.eligibility`: 2+ ranks, no more ranks than CPUs, x86
   or a native library that loads (aarch64), memory for the segment, no ``CPUDDP_SHM=0``).
   Measured on one node (a 2-vCPU AMD EPYC, AVX2,
   torch 2.13), 2 ranks, 1 MiB:
   shm 0.36 ms, gloo 2.26 ms, oneCCL 6.99 ms (oneCCL 19x slower than shm; at 64 MiB 2.6x).
   So shm wins over a working oneCCL too.
2. Between nodes, the shm group's node-to-node leg (``ShmOptions.inter``) runs on MPI through
   mpi4py when an MPI launcher (or srun) started the job and mpi4py finds an MPI library
   (:meth:`cpuddp.backends.torch_backends.MpiBackend.leg_status`; every rank then checks that
   MPI's world is the launcher's before it is used, else gloo), else on oneCCL when its bindings
   work here, else on gloo.  A 4 KiB all_reduce between two hosts took 41 us over MPI and
   1,600 us over gloo's TCP (docs/multinode.md).
3. Where a node runs one rank (so no node shares memory) and the MPI leg can run: shm all the
   same, its every collective over MPI (the gain of MPI's latency over gloo's, without shared
   memory), unless the user opted out of shm (``CPUDDP_SHM=0``).
4. Where shm cannot run otherwise (oversubscribed, opted out, not x86 and no native library, no MPI): across nodes
   oneCCL when its bindings work (node-to-node is what it is built for), else gloo; on one
   node gloo -- oneCCL measured slower than gloo on one node at every size up to 16 MiB
   (1 MiB: 6.99 vs 2.26 ms, and 11.7 vs 2.9 ms in another run; docs/backends.md).

With ``device="cuda"``: nccl when it can run, else gloo.  A named backend is never replaced:
``backend="ccl"`` is oneCCL everywhere (no shm within nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["AutoFacts", "AutoDecision", "auto_rule", "inter_leg", "RULE"]

#: The rule in one sentence (README, backends.md, troubleshooting.md, doctor say the same).
RULE = ("within a node shared memory (shm) when the node is eligible; between nodes the shm group's "
        "node-to-node leg on MPI (mpi4py) under an MPI launcher, else oneCCL when its bindings work, else gloo; "
        "nodes of one rank over that MPI leg too; where shm cannot run, oneCCL across nodes when it works, "
        "else gloo (on one node gloo: oneCCL measured slower there); nccl for CUDA models")
_MEASURED = "measured 1 MiB, 2 ranks on one node: shm 0.36 ms, gloo 2.26 ms, ccl 6.99 ms"
_MEASURED_CCL_GLOO = "measured on one node, 2 ranks: ccl 3-4x slower than gloo at 1 MiB"
_MEASURED_MPI = "measured between 2 hosts: a 4 KiB all_reduce 41 us over MPI, 1,600 us over gloo"


@dataclass(frozen=True)
class AutoFacts:
    """What the rule needs, as plain data (gathered by :func:`cpuddp.backends.resolve_backend`)."""

    local_ranks: int
    nodes: int
    shm_ok: bool
    shm_why: str
    ccl_ok: bool
    ccl_why: str
    device: str = "cpu"
    nccl_ok: bool = False
    nccl_why: str = "nccl was not checked"
    #: Whether the MPI leg can run here (an MPI launcher, mpi4py with a library), and why (not).
    mpi_ok: bool = False
    mpi_why: str = "MPI was not checked"
    #: Whether some node runs a single rank (the shm group would run every collective on its leg).
    single_rank_node: bool = False
    #: Whether the user opted out of shm (CPUDDP_SHM=0).
    shm_opted_out: bool = False


@dataclass(frozen=True)
class AutoDecision:
    """The backend, the shm group's node-to-node leg (None when not shm or one node), and why."""

    backend: str
    inter: Optional[str]
    reason: str


def inter_leg(nodes: int, ccl_ok: bool, ccl_why: str, mpi_ok: bool = False,
              mpi_why: str = "MPI was not checked") -> tuple[Optional[str], str]:
    """The shm group's node-to-node leg and why (None: a single node has no such leg)."""
    if nodes <= 1:
        return None, ""
    if mpi_ok:
        return "mpi", f"between the {nodes} nodes MPI ({mpi_why})"
    if ccl_ok:
        return "ccl", f"between the {nodes} nodes oneCCL ({ccl_why}; no MPI leg: {mpi_why})"
    return "gloo", f"between the {nodes} nodes gloo (no MPI leg: {mpi_why}; no working oneCCL: {ccl_why})"


def auto_rule(f: AutoFacts) -> AutoDecision:
    """The backend ``"auto"`` means for these facts; see the module's docstring for the rule."""
    if f.device == "cuda":
        if f.nccl_ok:
            return AutoDecision("nccl", None, f"the model is on CUDA and {f.nccl_why}")
        return AutoDecision("gloo", None, f"the model is on CUDA but nccl cannot run ({f.nccl_why})")
    if f.shm_ok:
        inter, why_inter = inter_leg(f.nodes, f.ccl_ok, f.ccl_why, f.mpi_ok, f.mpi_why)
        within = f"within a node shared memory: {f.shm_why}"
        if f.ccl_ok and f.nodes <= 1:
            within += f"; preferred to the working oneCCL ({_MEASURED})"
        return AutoDecision("shm", inter, within + (f"; {why_inter}" if inter else ""))
    if f.mpi_ok and f.nodes > 1 and f.single_rank_node and not f.shm_opted_out:
        return AutoDecision("shm", "mpi", f"a node runs a single rank, so every collective over MPI between the "
                            f"{f.nodes} nodes ({f.mpi_why}; {_MEASURED_MPI})")
    if f.ccl_ok and f.nodes > 1:
        return AutoDecision("ccl", None, f"{f.nodes} nodes and {f.ccl_why}; no shared memory: {f.shm_why}; "
                            f"no MPI leg: {f.mpi_why}")
    if f.ccl_ok:
        return AutoDecision("gloo", None, f"no shared memory ({f.shm_why}), and on one node gloo rather than the "
                            f"working oneCCL ({_MEASURED_CCL_GLOO})")
    no_mpi = f"; no MPI leg: {f.mpi_why}" if f.nodes > 1 else ""
    return AutoDecision("gloo", None, f"no shared memory ({f.shm_why}) and no working oneCCL ({f.ccl_why}){no_mpi}")
