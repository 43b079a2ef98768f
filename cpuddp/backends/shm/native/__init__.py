"""The shm engine's native data path: the binding of ``engine.c`` (ctypes), and the choice of path.

One node-local collective is one call into the library (``engine.c`` says what it does and how
it orders memory); ctypes releases the GIL for it.  This module:

* **loads** the library from this package's own directory only (:data:`~.build.LIB_NAME`, built
  by ``pip install`` when a C compiler is there -- ``setup.py`` -- or by ``python -m
  cpuddp.backends.shm.native.build``), and only when it is this user's or root's and nobody
  else can write it or its directory, its ABI and source digest are this package's, it was built
  from this package's ``layout.h`` (every value, and the sizes of the structs the binding
  shares: :mod:`.layout`), and it passes a self-test at every vector width the CPU has
  (:func:`load`).  Anything else: the Python engine runs, and :func:`status` says why
  (``cpuddp doctor``'s shm line, ``data path python (<why>)``; the group's reason in the log).
* **settings**: ``CPUDDP_SHM_NATIVE`` -- ``0`` forces the Python engine, ``1`` requires the
  native one (an error where it cannot load), unset or ``auto`` uses it where it loads;
  ``CPUDDP_SHM_ISA`` -- ``scalar``, ``avx2`` or ``avx512`` (a width the CPU has; default the
  widest), so tests compare every width.
* **agrees** the path when a group forms (:func:`form`): every local rank writes what it has
  into its control line, one round, and the node runs native only if every rank has the same
  library; otherwise every rank runs Python (and the reason is logged).
* **guards** every call (:class:`Engine`): only contiguous CPU tensors of a dtype and op the
  library reduces reach it (the callers stage the rest: :mod:`cpuddp.backends.shm.group.calls`,
  and the routes that use it, :mod:`~cpuddp.backends.shm.routes.direct` and ``progress``); every
  pointer and length it gets is a tensor's own; inputs that overlap outputs in any way but the
  one each collective allows stay on the Python path.  An error code becomes the same error the
  Python engine raises (a mismatch naming both calls, a dead or departed peer, a rank that gave
  up, the timeout).

Owns: the library's loading, settings and binding, and the path a node agrees on; the C sources
(``engine.c``, ``kernels.h``), their build and its record (:mod:`.build`), the platform a
built library needs (:mod:`.elf`, the wheels' tag), and ``layout.h`` -- the segment's layout,
the library's interface and the wait policy, defined once -- with its reader (:mod:`.layout`),
which the Python engine uses too.  It is handed the segment and channel it works over: it
imports no other module of the shm backend.
May import: :mod:`cpuddp.errors`
"""

from __future__ import annotations

import ctypes
import os
import stat
from typing import Any, Dict, Mapping, Optional, Tuple

from . import layout
from .layout import (ABI, AT_POST, AT_ROUND, AT_SETTLE, DESC_WORDS, ENTRY_FIELDS, K_ALL_GATHER, K_ALL_REDUCE,
                     K_BARRIER, K_BROADCAST, K_REDUCE, K_REDUCE_SCATTER, RC_ABORT, RC_AGAIN, RC_BUSY, RC_CLOSED,
                     RC_DEAD, RC_LEFT, RC_MISMATCH, RC_OK, RC_TIMEOUT, STATE_FIELDS)


__all__ = ["Counters", "VAR", "ISA_VAR", "ISAS", "setting", "isa_setting", "load", "status", "unavailable", "form",
           "Engine", "DTYPES", "Unavailable"]

VAR = "CPUDDP_SHM_NATIVE"
ISA_VAR = "CPUDDP_SHM_ISA"
#: vector widths, by their codes (layout.h's ISA_*)
ISAS = tuple(name[len("ISA_"):].lower() for name, _ in
             sorted(((n, v) for n, v in layout.VALUES.items() if n.startswith("ISA_")), key=lambda nv: nv[1]))
#: int64 words of a prepared call (engine.c's entry_t): the descriptor's, then :data:`ENTRY_FIELDS`
ENTRY_WORDS = DESC_WORDS + len(ENTRY_FIELDS)
#: the agreement's dtype codes (cpuddp.backends.shm.protocol.descriptor) the library moves and reduces
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64")
#: how long one wait inside the library's drain lasts before Python runs again (signal handlers)
_DRAIN_NS = 50_000_000
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


class Unavailable(Exception):
    """The native library cannot be used here; the message says why."""


class Counters(ctypes.Structure):
    """A channel's counters, shared by the Python engine and ``engine.c`` (its ``state_t``:
    layout.h's ``CPUDDP_SHM_STATE_FIELDS``)."""

    _fields_ = [(name, ctypes.c_int64) for name in STATE_FIELDS]


def setting(environ: Mapping[str, str] = os.environ) -> Optional[bool]:
    """``CPUDDP_SHM_NATIVE``: False (``0``), True (``1``: required) or None (unset/``auto``)."""
    raw = (environ.get(VAR) or "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in _OFF:
        return False
    if raw in _ON:
        return True
    from cpuddp.errors import BackendError

    raise BackendError(f"{VAR}={environ.get(VAR)!r} is neither 0, 1 nor auto",
                       fix=f"set {VAR}=0 (the Python engine), {VAR}=1 (require the native one) or auto, or unset it")


class _Lib:
    """The loaded library with its functions' signatures."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        sigs = {
            "cpuddp_shm_abi": (i32, []),
            "cpuddp_shm_digest": (ctypes.c_char_p, []),
            "cpuddp_shm_isa_supported": (i32, [i32]),
            "cpuddp_shm_isa_compiled": (i32, [i32]),
            "cpuddp_shm_best_isa": (i32, []),
            "cpuddp_shm_reduces": (i32, [i32, i32]),
            "cpuddp_shm_ctx_size": (i64, []),
            "cpuddp_shm_init": (i32, [vp, vp, vp, i64, i64, i64, i64, i64, i32, i32, i32, vp, i32, i32, i64]),
            "cpuddp_shm_entry_size": (i64, []),
            "cpuddp_shm_state_size": (i64, []),
            "cpuddp_shm_layout_count": (i32, []),
            "cpuddp_shm_layout_name": (ctypes.c_char_p, [i32]),
            "cpuddp_shm_layout_value": (i64, [i32]),
            "cpuddp_shm_call": (i32, [vp, vp, vp, vp]),
            "cpuddp_shm_resume": (i32, [vp]),
            "cpuddp_shm_drop": (None, [vp]),
            "cpuddp_shm_reduce_rows": (i32, [i32, i32, i32, vp, vp, i32, i64]),
            "cpuddp_shm_start": (i32, [vp]),
            "cpuddp_shm_submit": (i64, [vp, vp, vp, vp]),
            "cpuddp_shm_wait": (i32, [vp, i64, i64, vp]),
            "cpuddp_shm_pending": (i64, [vp]),
            "cpuddp_shm_drain": (i32, [vp, i64]),
            "cpuddp_shm_stop": (None, [vp]),
            "cpuddp_shm_fence": (None, []),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name[len("cpuddp_shm_"):], fn)
        self.path = path


def _trusted(path: str) -> Optional[str]:
    """Why ``path`` (and its directory) may not be loaded, or None: a regular file of this uid
    or root that no one else can write, in a directory no one else can write."""
    me = os.geteuid()
    for p, what in ((path, "the library"), (os.path.dirname(path), "its directory")):
        st = os.lstat(p)
        if what == "the library" and not stat.S_ISREG(st.st_mode):
            return f"{what} {p} is not a regular file"
        if st.st_uid not in (0, me):
            return f"{what} {p} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022:
            return f"{what} {p} is writable by others (mode {oct(st.st_mode & 0o777)})"
    return None


def _abi(path: str) -> int:
    """The ABI of the library at ``path`` (asked before anything else of it is looked up)."""
    fn = ctypes.CDLL(path).cpuddp_shm_abi
    fn.restype, fn.argtypes = ctypes.c_int, []
    return int(fn())


def _layout_problem(lib: _Lib) -> Optional[str]:
    """How the library's layout.h differs from this package's (a value, or a struct's size), or None."""
    theirs = {lib.layout_name(i).decode(): int(lib.layout_value(i)) for i in range(lib.layout_count())}
    for name, value in layout.VALUES.items():
        if theirs.get(name) != value:
            return f"its {name} is {theirs.get(name, 'missing')}, this package's {value}"
    extra = sorted(set(theirs) - set(layout.VALUES))
    if extra:
        return f"it has {', '.join(extra)}, which this package's layout.h lacks"
    for what, got, want in (("entry_t", lib.entry_size(), 8 * ENTRY_WORDS),
                            ("state_t", lib.state_size(), ctypes.sizeof(Counters))):
        if got != want:
            return f"its {what} has {got} bytes, this package's {want}"
    return None


def _self_test(lib: _Lib) -> Optional[str]:
    """Sum, min and bfloat16 rounding at every width the CPU has, against known answers."""
    a = (ctypes.c_float * 5)(1.5, -2.0, 3.25, float("nan"), 2.0 ** 100)
    b = (ctypes.c_float * 5)(0.25, 2.0, -1.0, 1.0, 2.0 ** 100)
    h = (ctypes.c_uint16 * 2)(0x3F80, 0x3F81)  # bfloat16 1.0 and 1.0078125
    rows = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
    hrows = (ctypes.c_void_p * 2)(ctypes.addressof(h), ctypes.addressof(h))
    for isa in range(len(ISAS)):
        if not lib.isa_supported(isa):
            continue
        out = (ctypes.c_float * 5)()
        hout = (ctypes.c_uint16 * 2)()
        if (lib.reduce_rows(isa, 0, 0, ctypes.addressof(out), rows, 2, 5)
                or lib.reduce_rows(isa, 0, 3, ctypes.addressof(hout), hrows, 2, 2)):
            return f"its {ISAS[isa]} kernels refused a valid call"
        got = list(out)
        if got[:3] != [1.75, 0.0, 2.25] or got[3] == got[3] or got[4] != 2.0 ** 101:
            return f"its {ISAS[isa]} float32 sum gave {got}"
        if list(hout) != [0x4000, 0x4001]:
            return f"its {ISAS[isa]} bfloat16 sum gave {[hex(v) for v in hout]}"
    return None


_loaded: Optional[Tuple[Optional[_Lib], str]] = None


def load() -> _Lib:
    """The library, loaded and checked once per process; raises :class:`Unavailable` (why) if
    it cannot be used."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    lib, why = _loaded
    if lib is None:
        raise Unavailable(why)
    return lib


def _load(where: Optional[str] = None) -> Tuple[Optional[_Lib], str]:
    from . import build as _build  # not at import: ``python -m cpuddp.backends.shm.native.build`` runs it

    path = os.path.join(where or _build.HERE, _build.LIB_NAME)
    if not os.path.exists(path):
        return None, _build.explain(_build.read_record(path), _build.compiler())
    why = _trusted(path)
    if why is not None:
        return None, f"{why}: not loaded"
    try:
        abi = _abi(path)
        if abi != ABI:
            return None, f"its library has ABI {abi}, this package {ABI}: rebuild it (pip install again)"
        lib = _Lib(path)
    except (OSError, AttributeError) as exc:
        return None, f"its library does not load: {exc}"
    try:
        want = _build.digest()
    except OSError:
        want = None  # an install without the sources: the ABI check stands
    got = lib.digest().decode()
    if want is not None and got != want:
        return None, ("its library was built from other sources (an older build); rebuild it: pip install again, "
                      "or 'python -m cpuddp.backends.shm.native.build'")
    problem = _layout_problem(lib)
    if problem is not None:
        return None, (f"its library was built from another layout.h ({problem}); rebuild it: pip install again, "
                      "or 'python -m cpuddp.backends.shm.native.build'")
    problem = _self_test(lib)
    if problem is not None:
        return None, f"its library failed its self-test: {problem}"
    return lib, ""


def isa_setting(lib: _Lib, environ: Mapping[str, str] = os.environ) -> int:
    """``CPUDDP_SHM_ISA`` as engine.c's code (a width this CPU has), else the widest it has."""
    raw = (environ.get(ISA_VAR) or "").strip().lower()
    if raw in ("", "auto"):
        return int(lib.best_isa())
    from cpuddp.errors import BackendError

    have = [name for i, name in enumerate(ISAS) if lib.isa_supported(i)]
    if raw not in ISAS:
        raise BackendError(f"{ISA_VAR}={environ.get(ISA_VAR)!r} is not a vector width of the shm engine",
                           fix=f"set {ISA_VAR} to one of {', '.join(have)} (this CPU's), or unset it")
    if raw not in have:
        raise BackendError(f"{ISA_VAR}={raw}: this CPU has no {raw} (it has {', '.join(have)})",
                           fix=f"set {ISA_VAR} to one of {', '.join(have)}, or unset it")
    return ISAS.index(raw)


def status(environ: Mapping[str, str] = os.environ) -> Tuple[bool, str]:
    """``(native, text)``: the data path a group formed now would take on this rank, and why
    (``native (avx512)``, ``python (CPUDDP_SHM_NATIVE=0)``, ...)."""
    try:
        wanted = setting(environ)
    except Exception as exc:  # noqa: BLE001 - shown, not raised (cpuddp doctor)
        return False, f"python ({exc})"
    if wanted is False:
        return False, f"python ({VAR}={environ.get(VAR)})"
    try:
        lib = load()
        isa = isa_setting(lib, environ)
    except Unavailable as exc:
        return False, f"python ({exc})"
    except Exception as exc:  # noqa: BLE001
        return False, f"python ({exc})"
    return True, f"native ({ISAS[isa]}{_unvectorised(lib)})"


def unavailable(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """Why a group formed now would take the Python data path on this rank, in :func:`status`'s
    words (``CPUDDP_SHM_NATIVE=0``, why the library does not load), or None: the native one."""
    native, text = status(environ)
    return None if native else text[len("python ("):-1]


def _unvectorised(lib: _Lib) -> str:
    """On x86, a library whose compiler compiled no vector width says so (its widths run scalar code)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i686") or lib.isa_compiled(ISAS.index("avx2")):
        return ""
    return ": its compiler compiled no vector kernels; build it with gcc or clang for avx2/avx512"


# --------------------------------------------------------------------------- forming


def _token(lib: Optional[_Lib]) -> int:
    """What this rank writes into its control line: its library's source digest as a number (1
    and up), or 0 without one.  A library built without the digest (by hand: it reads
    ``unknown``, and loads only where the sources are absent) is known by its own bytes."""
    if lib is None:
        return 0
    digest = lib.digest().decode()
    try:
        value = int(digest, 16)
    except ValueError:
        import hashlib

        with open(lib.path, "rb") as f:
            value = int(hashlib.sha256(f.read()).hexdigest()[:16], 16)
    return 1 + value % (1 << 62)


def form(ch: Any, peers: Mapping[int, Any], timeout: float, word: int, environ: Mapping[str, str] = os.environ
         ) -> Tuple[Optional["Engine"], str]:
    """Agree the node's data path when a group forms: ``(engine or None, what the log says)``.
    Every local rank writes its library's token into word ``word`` of its control line; after
    one round each reads all of them: native only where every rank has the same library."""
    from cpuddp.errors import BackendError

    wanted = setting(environ)
    lib, why = None, f"{VAR}={environ.get(VAR)}"
    isa = 0
    if wanted is not False:
        try:
            lib = load()
            isa = isa_setting(lib, environ)
        except Unavailable as exc:
            why = str(exc)
    seg = ch.seg
    seg.lines[ch.me][word] = _token(lib)
    ch.round(ch.next_round())
    tokens = [seg.lines[i][word] for i in range(ch.n)]
    if lib is not None and len(set(tokens)) == 1:
        return Engine(lib, ch, peers, timeout, isa), f"native data path, {ISAS[isa]}"
    if lib is not None:
        odd = [ch.local[i] for i, t in enumerate(tokens) if t != tokens[ch.me]]
        why = f"rank(s) {odd} on this node have {'no' if not all(tokens) else 'another'} native library"
    if wanted:
        raise BackendError(f"{VAR}=1 requires the shm engine's native data path, and this node cannot run it: {why}",
                           fix=f"build it (pip install again with a C compiler, or 'python -m "
                               f"cpuddp.backends.shm.native.build'), or unset {VAR}")
    return None, f"Python data path: {why}"


# --------------------------------------------------------------------------- calls


class Engine:
    """One group's native context over its channel's segment (see the module docstring)."""

    def __init__(self, lib: _Lib, ch: Any, peers: Mapping[int, Any], timeout: float, isa: int) -> None:
        seg = ch.seg
        self.lib, self.ch, self.isa = lib, ch, isa
        self._peers = dict(peers)  # their pidfds stay open while the context names them
        self.state = ch.state
        self._ctx = ctypes.create_string_buffer(int(lib.ctx_size()))
        self.ctx = ctypes.addressof(self._ctx)
        pidfds = (ctypes.c_int * seg.size)(*[getattr(self._peers.get(i), "pidfd", None) or -1
                                             for i in range(seg.size)])
        rc = lib.init(self.ctx, ctypes.addressof(self.state), ctypes.addressof(seg.words), seg.counters_at,
                      seg.ring_at[0], seg.slots_at, seg.slot, seg.total, seg.size,
                      seg.local_rank, seg.fd, pidfds, int(ch.waiter.spin), isa, int(timeout * 1e9))
        if rc:
            raise Unavailable(f"its context refused this segment ({rc})")
        self._reduces: Dict[Tuple[Any, Any], bool] = {}
        self._entries: Dict[Any, Any] = {}
        self._call = lib.call
        self._codes: Dict[Any, int] = {}

    # ------------------------------------------------------------------ what it takes

    def dtype_code(self, dtype: Any) -> int:
        """The library's code of ``dtype`` (one :func:`reduces` accepted)."""
        code = self._codes.get(dtype)
        if code is None:
            code = self._codes[dtype] = DTYPES.index(str(dtype).rsplit(".", 1)[-1])
        return code

    def reduces(self, code: Any, dtype: Any) -> bool:
        """Does the library reduce ``dtype`` with ``code`` (a pure fact: the same on every rank)?"""
        key = (code, dtype)
        ok = self._reduces.get(key)
        if ok is None:
            name = str(dtype).rsplit(".", 1)[-1]
            ok = self._reduces[key] = name in DTYPES and bool(self.lib.reduces(int(code), DTYPES.index(name)))
        return ok

    # ------------------------------------------------------------------ the collectives

    def entry(self, call: Any, kind: int, dtype: int, op: int, root: int, numel: int, m: int) -> Any:
        """The library's prepared form of ``call`` (engine.c's ``entry_t``), made once per call
        shape: its descriptor, collective, dtype code (-1: bytes), op, local root and sizes.
        Remembered by all of them, not by the descriptor alone: the sizes are the ones the
        library copies, and two calls may agree on a descriptor yet move different byte counts."""
        key = (call, kind, dtype, op, root, numel, m)
        e = self._entries.get(key)
        if e is None:
            if len(self._entries) >= 4096:
                self._entries.clear()
            fields = {"kind": kind, "dtype": dtype, "op": op, "root": root, "numel": numel, "m": m}
            e = self._entries[key] = (ctypes.c_int64 * ENTRY_WORDS)(*call.words(), *(fields[f] for f in ENTRY_FIELDS))
        return e

    def all_reduce(self, call: Any, flat: Any, code: Any) -> Tuple[Any, int, Optional[int]]:
        """``flat``: a contiguous 1-D tensor (in and out); ``code`` an op it reduces (AVG: the
        caller divides).  Each collective gives its job: ``(entry, a, b)`` for :meth:`run` or
        :meth:`cpuddp.backends.shm.routes.progress.Progress.submit`."""
        n = flat.numel()
        return self.entry(call, K_ALL_REDUCE, self.dtype_code(flat.dtype), int(code), 0, n, n), flat.data_ptr(), None

    def reduce(self, call: Any, flat: Any, root: int, code: Any) -> Tuple[Any, int, Optional[int]]:
        n = flat.numel()
        return self.entry(call, K_REDUCE, self.dtype_code(flat.dtype), int(code), root, n, n), flat.data_ptr(), None

    def broadcast(self, call: Any, flat: Any, root: int) -> Tuple[Any, int, Optional[int]]:
        """``flat``: contiguous 1-D bytes."""
        n = flat.numel()
        return self.entry(call, K_BROADCAST, -1, 0, root, n, n), flat.data_ptr(), None

    def barrier(self, call: Any) -> Tuple[Any, Optional[int], Optional[int]]:
        return self.entry(call, K_BARRIER, -1, 0, 0, 0, 0), None, None

    def all_gather(self, call: Any, out: Any, inp: Any) -> Tuple[Any, int, int]:
        """``out``: contiguous bytes, ``n`` rows of ``inp``'s size; ``inp``: this rank's row of
        ``out`` or apart from it."""
        n = inp.numel()
        return self.entry(call, K_ALL_GATHER, -1, 0, 0, n, n), out.data_ptr(), inp.data_ptr()

    def reduce_scatter(self, call: Any, out: Any, inp: Any, code: Any) -> Tuple[Any, int, int]:
        """``out``: ``m`` elements; ``inp``: ``n * m`` elements apart from ``out``; both contiguous."""
        m = out.numel()
        e = self.entry(call, K_REDUCE_SCATTER, self.dtype_code(out.dtype), int(code), 0, m, m)
        return e, out.data_ptr(), inp.data_ptr()

    def run(self, call: Any, job: Tuple[Any, Optional[int], Optional[int]]) -> None:
        """Run ``job`` (one collective's) in this thread; calls still queued on the progress
        thread run first (``RC_BUSY``: the library did nothing yet)."""
        rc = self._call(self.ctx, *job)
        if rc == RC_BUSY:
            self.drain()
            rc = self._call(self.ctx, *job)
        self.done(rc, call)

    def drain(self) -> None:
        """Wait until the progress thread has run every call queued so far (their results stay
        for its waiter); at once where none is queued or no thread runs."""
        while self.lib.drain(self.ctx, _DRAIN_NS) == RC_AGAIN:  # back in Python now and then: signals
            pass

    # ------------------------------------------------------------------ results

    def done(self, rc: int, call: Any) -> None:
        """Finish a call that returned ``rc``: resume it while it says AGAIN, raise its error."""
        if rc == RC_OK:
            return
        try:
            while rc == RC_AGAIN:  # back in Python every 50 ms of waiting: signal handlers run here
                rc = self.lib.resume(self.ctx)
        except BaseException:
            self.lib.drop(self.ctx)
            raise
        if rc != RC_OK:
            self._raise(rc, call)

    def _raise(self, rc: int, call: Any) -> None:
        st = self.state
        self.raise_error(rc, call, int(st.err_peer), int(st.err_where), int(st.err_value))

    def error(self, rc: int, call: Any, peer: int, where: int, value: int) -> Exception:
        """:meth:`raise_error`'s exception, returned (the progress thread's results)."""
        try:
            self.raise_error(rc, call, peer, where, value)
        except Exception as exc:  # noqa: BLE001 - it is the result
            return exc
        raise AssertionError("raise_error returned")  # pragma: no cover

    def raise_error(self, rc: int, call: Any, peer: int, where: int, value: int) -> None:
        """The Python engine's error for engine.c's result ``rc`` (``peer``, ``where``, ``value``: what it names)."""
        import torch.distributed as dist

        ch = self.ch
        what = {AT_POST: f"call #{value} to be checked",
                AT_SETTLE: f"collective call #{value} ({ch.describe(call)})",
                AT_ROUND: f"a shared-memory round ({value})"}.get(where, "a collective")
        if rc == RC_MISMATCH:
            ch.ring.mismatch(value, call, ch.local)
        elif rc in (RC_DEAD, RC_LEFT):
            ch.waiter.check_peers([peer], what)
            raise dist.DistBackendError(f"shm: local rank {peer} {'left' if rc == RC_LEFT else 'died'} while rank "
                                        f"{ch.rank} waited for it in {what}")
        elif rc == RC_ABORT:
            ch.waiter.check_abort()
        elif rc == RC_TIMEOUT:
            raise ch.waiter.timed_out([peer], what)
        elif rc == RC_CLOSED:
            raise dist.DistBackendError(f"shm: the group was shut down while rank {ch.rank} waited in {what}")
        raise dist.DistBackendError(f"shm: the native data path refused a call ({rc}) in {what}; this is a bug")
