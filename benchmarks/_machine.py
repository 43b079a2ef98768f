"""What every benchmark's result names: the machine it ran on."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name and this machine's CPU count, e.g. ``"AMD EPYC, 2 vCPUs"``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f", {os.cpu_count()} vCPUs"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
