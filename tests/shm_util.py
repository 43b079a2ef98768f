"""Start a tests/scripts/ rank script as plain torch.distributed ranks (rank 0 hosts the store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence


def launch_ranks(script: Path, n: int, mode: str, outdir: Path, *, timeout: float = 90,
                 env: Optional[dict] = None, prefix: Optional[Sequence[Sequence[str]]] = None) -> list[dict]:
    """Run ``script MODE OUTDIR`` as ``n`` ranks; their ``OUTDIR/rank<r>.json`` reports (or, for a
    rank that wrote none, the tail of its output).  ``prefix[r]``: words before rank r's command
    (e.g. ``unshare --pid``)."""
    from failure_scripts.procs import free_port  # plain torch env:// ranks need a MASTER_PORT
    from cpuddp.testing import clean_environ

    port = free_port()
    procs = []
    for r in range(n):
        e = clean_environ(os.environ)
        e.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                 OMP_NUM_THREADS="1", **(env or {}))
        words = list(prefix[r]) if prefix else []
        procs.append(subprocess.Popen([*words, sys.executable, str(script), mode, str(outdir)], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = []
    for r, out in enumerate(outs):
        path = outdir / f"rank{r}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {"output": out[-3000:]})
    return reports


#: The words that start a command in a PID namespace of its own.
UNSHARE_PID = ("unshare", "--pid", "--fork", "--mount-proc")


def unshare_pid_or_skip() -> tuple:
    """:data:`UNSHARE_PID`, or skip the test where a new PID namespace cannot be had (not root,
    no unshare(1), or the kernel refuses)."""
    import shutil

    import pytest

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a rank in another PID namespace")
    probe = subprocess.run([*UNSHARE_PID, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid is refused here: {probe.stderr.decode()[:200]}")
    return UNSHARE_PID
