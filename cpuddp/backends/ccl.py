"""The oneCCL bindings: which distribution and module, whether they fit this torch, and what
to install when they do not.

The installed versions are read with ``importlib.metadata`` *before* anything is imported
(importing a wheel built for another torch can abort the interpreter) from the
distributions ``oneccl_bind_pt`` (every wheel since 1.10) and ``torch-ccl`` (older builds);
the module is ``oneccl_bindings_for_pytorch`` from 1.12 on and ``torch_ccl`` before.  A
binding matches when :func:`cpuddp._compat.torch_pairing` says so (same major.minor, plus the
exact pairs in :data:`CCL_EXACT_TORCH`).  A binding whose version names another torch is
import-probed in a child process (:mod:`cpuddp.backends.ccl_probe`) and used when that import works.
``CPUDDP_CCL_SKIP_VERSION_CHECK=1`` skips both checks.

:class:`CclBackend` is the ``ccl`` backend as the pipeline sees it (:mod:`cpuddp.backends.types`):
:func:`ccl_status` its check, :func:`ccl_fix` what a refusal says, the import refused unless it
was checked against torch, oneCCL's variables (:func:`cpuddp.backends.settings.ccl_env`) and
worker cores (``CCL_WORKER_COUNT``), its failure explained (:func:`cpuddp.backends.failure.ccl_failure`),
and a group of it as the shm group's node-to-node leg.
"""

from __future__ import annotations

import datetime
import sys
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Tuple

from cpuddp._compat import torch_pairing
from cpuddp.affinity.ccl_workers import worker_count
from cpuddp.errors import BackendError

from .failure import ccl_failure
from .settings import ccl_env
from .types import (BackendChoice, BackendName, BackendSpec, BackendStatus, Lookups, _canon, _lookups, _torch_version,
                    _truthy)

if TYPE_CHECKING:  # pragma: no cover
    from cpuddp.launchers.env import DistEnv

__all__ = ["CCL_DISTRIBUTIONS", "CCL_EXACT_TORCH", "SKIP_VERSION_CHECK_VAR", "ccl_module_for", "ccl_pairing",
           "ccl_status", "ccl_fix", "CclBackend"]

#: Distributions that carry the oneCCL bindings, in the order they are looked up.
#: ``oneccl_bind_pt`` is the wheel's name since 1.10 (whatever its module); ``torch-ccl``
#: (also spelled ``torch_ccl``) is what older source builds installed.
CCL_DISTRIBUTIONS: Tuple[str, ...] = ("oneccl_bind_pt", "torch-ccl", "torch_ccl")
#: From this version on the module is ``oneccl_bindings_for_pytorch``; before, ``torch_ccl``.
_CCL_RENAMED_AT = (1, 12)
#: Bindings Intel built for one torch patch release only (intel/torch-ccl README table; the
#: seeds: "1.12.0 prebuilt wheel does not work with PyTorch 1.12.1").  Others need major.minor.
CCL_EXACT_TORCH = {
    (1, 12, 0): (1, 12, 0),
    (1, 12, 100): (1, 12, 1),
    (2, 0, 100): (2, 0, 1),
    (2, 3, 100): (2, 3, 1),
}
#: Intel's last oneCCL bindings release.
_CCL_LAST_RELEASE = (2, 8)
#: Set to 1 to accept oneCCL bindings whatever their version (a source build for this torch).
SKIP_VERSION_CHECK_VAR = "CPUDDP_CCL_SKIP_VERSION_CHECK"
_CPU_INDEX = "https://pytorch-extension.intel.com/release-whl/stable/cpu/us/"


# --------------------------------------------------------------------------- versions


def _release(version: str) -> Optional[Tuple[int, ...]]:
    from packaging.version import InvalidVersion, Version

    try:
        rel = Version(version).release
    except InvalidVersion:
        return None
    return tuple(rel) + (0,) * (3 - len(rel))


def ccl_module_for(binding_version: str) -> str:
    """The module a oneCCL bindings version installs: ``torch_ccl`` before 1.12."""
    rel = _release(binding_version)
    if rel is not None and rel[:2] < _CCL_RENAMED_AT:
        return "torch_ccl"
    return "oneccl_bindings_for_pytorch"


def ccl_pairing(binding_version: str, torch_version: str) -> Tuple[bool, str]:
    """Does a oneCCL bindings version fit this torch?  Pure, compares numerically.

    Returns ``(ok, built_for)``, e.g. ``(False, "torch 2.8")`` or ``(True, "torch 1.12.1
    only")``; ``built_for`` says what the binding was made for.  The rule is
    :func:`cpuddp._compat.torch_pairing`'s, with the releases Intel built for one torch patch
    release (:data:`CCL_EXACT_TORCH`).
    """
    pairing = torch_pairing(binding_version, torch_version, exact=CCL_EXACT_TORCH)
    return pairing.ok, pairing.built_for


def _ccl_wheel_for(torch_version: str) -> Optional[str]:
    """The ``oneccl_bind_pt`` version to install for a torch, or None past Intel's last."""
    t = _release(torch_version)
    if t is None or t[:2] > _CCL_LAST_RELEASE:
        return None
    for b, tv in CCL_EXACT_TORCH.items():
        if tv == t[:3]:
            return _dotted(b)
    if any(b[:2] == t[:2] for b in CCL_EXACT_TORCH):
        return f"{_dotted(t[:2])}.0"
    return f"{_dotted(t[:2])}.*"


def _dotted(parts: Sequence[int]) -> str:
    return ".".join(str(p) for p in parts)



# --------------------------------------------------------------------------- checks


def ccl_status(lk: Lookups) -> BackendStatus:
    """The ``ccl`` backend's check: the first installed binding that fits, or why none does."""
    devices = ("cpu", "xpu")
    found: list[tuple[str, str]] = []
    seen: set[str] = set()
    for dist in CCL_DISTRIBUTIONS:
        version = lk.metadata(dist)
        key = _canon(dist)
        if version is not None and key not in seen:
            seen.add(key)
            found.append((dist, version))
    if not found:
        return BackendStatus(
            "ccl", False,
            f"no oneCCL bindings are installed (no distribution {' or '.join(CCL_DISTRIBUTIONS[:2])}; "
            f"torch is {_torch_version(lk) or 'of unknown version'})",
            devices=devices, distribution=CCL_DISTRIBUTIONS[0],
        )
    torch_version = _torch_version(lk)
    skip = _truthy(lk.environ.get(SKIP_VERSION_CHECK_VAR))
    problems = []
    for dist, version in found:
        module = ccl_module_for(version)
        ok, what, evidence = _ccl_verdict(lk, dist, version, module, torch_version, skip)
        if not ok:
            problems.append((dist, version, module, what, evidence))
            continue
        return BackendStatus("ccl", True, what, version=version, module=module, devices=devices, distribution=dist,
                             evidence=evidence)
    dist, version, module, _, evidence = problems[0]
    text = "; ".join(p[3] for p in problems)
    return BackendStatus("ccl", False, text, version=version, module=module, devices=devices, distribution=dist,
                         evidence=evidence)


def _ccl_verdict(lk: Lookups, dist: str, version: str, module: str, torch_version: Optional[str],
                 skip: bool) -> Tuple[bool, str, Optional[str]]:
    """One installed binding: ``(usable, why, evidence)``, evidence being what decided:
    ``"metadata"``, ``"import probe"``, the skip variable, or None (a broken install).

    Its version decides when it names this torch; otherwise a child process that imports it
    does (:mod:`cpuddp.backends.ccl_probe`), so a binding built for another torch is never imported
    in this interpreter."""
    if skip:
        if not lk.find_module(module):
            return False, f"{dist} {version} is installed without its module {module} (a broken install)", None
        return (True, f"{dist} {version} (version check skipped by {SKIP_VERSION_CHECK_VAR}=1), torch {torch_version}",
                SKIP_VERSION_CHECK_VAR)
    if torch_version is None:
        return False, f"{dist} {version} is installed and torch's version is unknown", "metadata"
    ok, built_for = ccl_pairing(version, torch_version)
    if not lk.find_module(module):
        named = "" if ok else f" is built for {built_for}, not torch {torch_version}, and"
        return False, f"{dist} {version}{named} is installed without its module {module} (a broken install)", None
    if ok:
        return True, f"{dist} {version} matches torch {torch_version}", "metadata"
    probe = lk.import_probe
    if probe is None:
        from .ccl_probe import check_import

        def probe(m: str, t: str) -> Any:
            return check_import(m, t, environ=lk.environ)

    verdict = probe(module, torch_version)
    if verdict.ok:
        return (True, f"{dist} {version} is built for this torch (import probe passed; its version names "
                f"{built_for}, torch is {torch_version})", "import probe")
    where = f"; verdict cached in {verdict.cache_file}" if getattr(verdict, "cache_file", None) else ""
    return (False, f"{dist} {version} is built for {built_for}, not torch {torch_version}, and importing it in a "
            f"child process failed -- {verdict.summary()} (not imported here: a binding built for another torch "
            f"can abort the interpreter{where})", "import probe")



def ccl_fix(torch_version: Optional[str]) -> str:
    """What to do when no oneCCL binding fits torch ``torch_version``."""
    wheel = _ccl_wheel_for(torch_version or "")
    if wheel is not None:
        return (
            f'pip install "oneccl_bind_pt=={wheel}" --extra-index-url {_CPU_INDEX} '
            f"(Intel's index; the bindings are not on PyPI), or pass backend='gloo'"
        )
    return (
        f"Intel's last oneCCL bindings are for torch {_dotted(_CCL_LAST_RELEASE)}; none exist for torch "
        f"{torch_version}: build intel/torch-ccl against this torch (docs/backends.md; a build that imports "
        f"cleanly is accepted whatever its version; {SKIP_VERSION_CHECK_VAR}=1 skips every check), or pass "
        f"backend='gloo'"
    )


# --------------------------------------------------------------------------- the backend


class CclBackend(BackendSpec):
    """oneCCL through its PyTorch bindings: what is its own of every step (the module docstring)."""

    def refusal(self, st: BackendStatus, lk: Lookups) -> BackendError:
        return BackendError(f"backend={self.name!r} was requested, but {st.reason}", fix=ccl_fix(_torch_version(lk)))

    def auto_choice(self, reason: str, inter: Optional[str], lk: Lookups, probe_torch: bool) -> BackendChoice:
        st = self.status(lk)
        return BackendChoice(self.name, f"auto: {reason}", st.module, BackendName.AUTO, st.version, st.distribution,
                             True)

    def worker_cores(self, choice: BackendChoice, environ: Mapping[str, str]) -> int:
        return worker_count(environ)

    def settings(self, env: "DistEnv", choice: BackendChoice, plan: Any, environ: Mapping[str, str], *,
                 paths: Any = None) -> dict[str, str]:
        return ccl_env(env, plan, environ, paths=paths)

    def _before_import(self, choice: BackendChoice) -> None:
        """Refuse bindings that do not match torch, even for a choice made elsewhere (importing
        them can abort the interpreter)."""
        if choice.verified or choice.module in sys.modules:
            return
        import torch

        st = self.status(_lookups())
        if not st.available or st.module != choice.module:
            raise BackendError(f"refusing to import {choice.module}: {st.reason}", fix=ccl_fix(torch.__version__))

    def _import_fix(self, pkg: str, torch_version: str) -> str:
        return f"reinstall {pkg} for torch {torch_version}"

    def explain_failure(self, environ: Mapping[str, str], exc: BaseException) -> BackendError:
        return ccl_failure(self.name, environ, exc)

    def create_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        """A oneCCL group for the shm group's node-to-node leg: the bindings loaded as for
        ``backend="ccl"`` (checked against torch, under either module name)."""
        import torch.distributed as dist

        st = self.status(_lookups())
        if not st.available:
            raise BackendError(f"the shm group's node-to-node leg is oneCCL, but {st.reason}",
                               fix="use gloo between nodes (CPUDDP_SHM_INTER=gloo), or "
                                   + ccl_fix(_torch_version(_lookups())))
        self.load(BackendChoice(self.name, "the shm group's node-to-node leg", st.module, version=st.version,
                                distribution=st.distribution, verified=True))
        plugin = dist.Backend._plugins.get(self.name.upper())
        if plugin is None:
            raise BackendError("the shm group's node-to-node leg is oneCCL, but the oneCCL bindings registered no "
                               "'ccl' backend", fix="use gloo between nodes, or install working oneCCL bindings")
        return plugin.creator_fn(store, rank, size, timeout)
