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
