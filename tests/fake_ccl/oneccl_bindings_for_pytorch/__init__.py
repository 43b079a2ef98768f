"""Test double of Intel's oneCCL bindings (module ``oneccl_bindings_for_pytorch``).

Registers backend ``ccl`` with ``torch.distributed``, delegating to gloo.  Its dist-info
beside it says ``oneccl_bind_pt 2.8.0+xpu``: what a source build of intel/torch-ccl says
whatever torch it was built against (tests copy it with other versions, see
tests/ccl_util.py).  Environment variables steer it:

``CPUDDP_FAKE_CCL``         ``ok`` (default); ``abort``: ``os.abort()`` on import, as a binding
                            built for another torch does; ``hang``: never returns from import;
                            ``silent``: imports but registers nothing.
``CPUDDP_FAKE_CCL_DELAY``   seconds the import takes (to make concurrent starts overlap).
``CPUDDP_FAKE_CCL_MARKER``  a file each import appends ``<pid>`` to: who imported it.
``CPUDDP_FAKE_CCL_RECORD``  a file the backend's creator writes JSON to: when it ran, the
                            affinity of every thread of the process at that moment, the
                            ``CCL_*``/``FI_*`` environment it saw, and the id of the
                            "worker" thread it starts (as oneCCL starts its workers).
"""

import json
import os
import sys
import threading
import time

assert "torch" in sys.modules, "torch must be imported before the oneCCL bindings"

_mode = os.environ.get("CPUDDP_FAKE_CCL", "ok")
if os.environ.get("CPUDDP_FAKE_CCL_MARKER"):
    with open(os.environ["CPUDDP_FAKE_CCL_MARKER"], "a") as _f:
        _f.write(f"{os.getpid()}\n")
time.sleep(float(os.environ.get("CPUDDP_FAKE_CCL_DELAY", "0")))
if _mode == "abort":
    print("terminate called after throwing an instance of 'c10::Error': Mismatch in kernel C++ signatures",
          file=sys.stderr, flush=True)
    os.abort()
if _mode == "hang":
    print("fake ccl: hanging in import", flush=True)
    while True:  # until the probe's timeout kills this child
        time.sleep(1)

import torch.distributed as dist  # noqa: E402

__version__ = "2.8.0+xpu"
_workers = []


def _cpus(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return ""


def _record():
    path = os.environ.get("CPUDDP_FAKE_CCL_RECORD")
    seen = {}
    ready = threading.Event()

    def worker():  # stands for a oneCCL worker thread: started by the communicator
        seen["worker_tid"] = threading.get_native_id()
        seen["worker_cpus_at_start"] = _cpus(seen["worker_tid"])
        ready.set()
        threading.Event().wait()  # a daemon thread: lives as long as the process

    t = threading.Thread(target=worker, name="fake-ccl-worker", daemon=True)
    t.start()
    ready.wait(10)
    _workers.append(t)
    if path:
        data = {
            "created_at": time.time(),
            "creator_tid": threading.get_native_id(),
            "threads": {tid: _cpus(tid) for tid in os.listdir("/proc/self/task")},
            "env": {k: v for k, v in os.environ.items() if k.startswith(("CCL_", "FI_", "I_MPI_ROOT", "OMP_"))},
            **seen,
        }
        with open(path, "w") as f:
            json.dump(data, f)


def _create(store, rank, size, timeout):
    _record()
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if _mode != "silent" and "ccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("ccl", _create, devices=["cpu"])
