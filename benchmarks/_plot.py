"""matplotlib for the benchmarks' plots, when it is installed: a missing plotting library costs
the plot, never the measurement (each script prints and saves its numbers first or anyway)."""

from __future__ import annotations

import sys
from typing import Any, Optional


def pyplot(what: str) -> Optional[Any]:
    """``matplotlib.pyplot`` on the Agg backend, or None (with a ``#`` line naming ``what`` and
    the fix) when matplotlib cannot be imported."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"# no plot for {what}: matplotlib is not installed ({exc}); the numbers are complete without it "
              "(pip install matplotlib, or the bench extra: pip install -e '.[bench]')", file=sys.stderr, flush=True)
        return None
    return plt
