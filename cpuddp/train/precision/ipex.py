"""Intel Extension for PyTorch (IPEX), behind a version probe.

IPEX calls ``exit()`` on import when its major.minor differs from torch's, which would take
the user's interpreter down with it.  So the installed versions are read with
:mod:`importlib.metadata` and compared as versions (:mod:`packaging.version`) *before* the
import is attempted.  IPEX is archived (last CPU release 2.8.0, for torch 2.8); on any
newer torch the stock PyTorch path is used instead.

Nothing here imports IPEX at module import time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["IpexProbe", "check_versions", "probe", "load", "bf16_weights"]

_log = logging.getLogger("cpuddp.prepare")

#: The distribution name on PyPI and the module it installs.
DIST_NAME = "intel-extension-for-pytorch"
MODULE_NAME = "intel_extension_for_pytorch"


@dataclass(frozen=True)
class IpexProbe:
    """Whether IPEX can be imported safely here, and why (not)."""

    usable: bool
    ipex_version: Optional[str]
    torch_version: str
    reason: str


def check_versions(ipex_version: Optional[str], torch_version: str) -> IpexProbe:
    """Pure decision: is IPEX ``ipex_version`` safe to import beside torch ``torch_version``?

    IPEX requires the same major.minor as torch (``2.8.0+cpu`` pairs with ``2.8.*``): the rule
    of :func:`cpuddp._compat.torch_pairing`, which ignores local labels (``+cpu``, ``+cu128``).
    """
    from cpuddp._compat import torch_pairing

    if ipex_version is None:
        return IpexProbe(False, None, torch_version, f"{DIST_NAME} is not installed")
    pairing = torch_pairing(ipex_version, torch_version)
    if pairing.error is not None:
        return IpexProbe(False, ipex_version, torch_version, f"unparsable version: {pairing.error}")
    if not pairing.ok:
        return IpexProbe(
            False,
            ipex_version,
            torch_version,
            f"{DIST_NAME} {ipex_version} is built for {pairing.built_for}.*, "
            f"but torch {torch_version} is installed (importing it would exit the interpreter)",
        )
    return IpexProbe(True, ipex_version, torch_version, f"{DIST_NAME} {ipex_version} matches torch {torch_version}")


def _installed_version() -> Optional[str]:
    try:
        version = importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return None
    # A distribution record without the module (a broken uninstall) is as good as absent.
    if importlib.util.find_spec(MODULE_NAME) is None:
        return None
    return version


def probe() -> IpexProbe:
    """Read the installed IPEX and torch versions (without importing IPEX) and decide."""
    import torch

    return check_versions(_installed_version(), torch.__version__)


def load() -> Any:
    """Import and return the IPEX module; only call after :func:`probe` said it is usable."""
    p = probe()
    if not p.usable:
        from cpuddp.errors import PrepareError

        raise PrepareError(f"cannot use IPEX: {p.reason}", fix="pip install a matching intel-extension-for-pytorch, or pass ipex=False")
    import intel_extension_for_pytorch as ipex  # noqa: F401  (heavy; only here)

    _log.debug("imported %s %s", MODULE_NAME, p.ipex_version)
    return ipex


def bf16_weights(ipex: Any) -> tuple[bool, str]:
    """Whether ``ipex.optimize(dtype=torch.bfloat16)`` can prepack bf16 weights on this CPU.

    IPEX asserts oneDNN's bf16 support (AVX-NE-CONVERT, or AVX512 BW+VL+DQ) only *after* it
    has cast the model and the optimizer to bf16, so a failed assert would leave them half
    converted: ask first.  A module without the probe is trusted.
    """
    probe_fn = getattr(getattr(ipex, "_C", None), "onednn_has_bf16_support", None)
    if probe_fn is None:
        return True, "IPEX has no bf16 probe; trusting the CPU flags"
    if probe_fn():
        return True, "IPEX's oneDNN has bf16 kernels on this CPU"
    return False, "IPEX's oneDNN has no bf16 kernels on this CPU (needs AVX-NE-CONVERT or AVX512 BW+VL+DQ)"
