"""Another local user attacking a shm job (tests/test_shm_faults.py).  Two roles:

``python3 shm_intruder.py user SECONDS DIR`` -- run AS THE OTHER USER, standard library only
(the job's virtual environment need not be readable by that user).  It

* pre-creates a world-writable look-alike segment file in /dev/shm (the old design mapped a path);
* serves a look-alike memfd (valid magic and size, the job's token once known) on an abstract
  socket of its own;
* connects to the job's real hand-over socket as soon as the job's offer is known, to obtain the
  job's segment;

and writes its offers to ``DIR/fake.json`` and its results to ``DIR/user.json``.

``python shm_intruder.py store HOST PORT SECONDS DIR`` -- writes those offers into the job's
rendezvous store as fast as it can and records the job's real offer in ``DIR/real.txt``.  The store
has no authentication, so which uid runs this role changes nothing (docs/security.md); it runs in
the test's environment because it needs torch's TCPStore client.
"""

import ctypes
import json
import mmap
import os
import secrets
import socket
import struct
import sys
import threading
import time

KEY = "default_pg/0//cpu//shm/seg/0"  # where a plain env:// job's default group keeps its offer
MAGIC = 0x6370756464707368


def user_role(seconds: float, where: str) -> None:
    deadline = time.monotonic() + seconds
    result = {"uid": os.geteuid(), "served": 0, "stolen_fds": 0, "steal_errors": []}
    path = f"/dev/shm/cpuddp-shm-0-{os.getpid()}-{secrets.token_hex(4)}"
    with open(path, "wb") as f:
        f.write(b"\0" * (8 << 20))
    os.chmod(path, 0o666)
    fake = os.memfd_create("cpuddp-shm")
    os.ftruncate(fake, 8 << 20)
    name = secrets.token_hex(16)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(b"\0cpuddp-shm-" + name.encode())
    srv.listen(8)
    srv.settimeout(0.05)
    with open(os.path.join(where, "fake.json.tmp"), "w") as f:
        json.dump({"sock": name, "path": path}, f)
    os.rename(os.path.join(where, "fake.json.tmp"), os.path.join(where, "fake.json"))
    real_file = os.path.join(where, "real.txt")

    def token() -> int:
        try:
            with open(real_file) as f:
                return int(f.read().split("\t")[2])
        except (OSError, IndexError, ValueError):
            return 1

    def serve() -> None:
        while time.monotonic() < deadline:
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.recv(16)
                    with mmap.mmap(fake, 4096) as head:
                        words = (ctypes.c_int64 * 8).from_buffer(head, 0)
                        words[0], words[1], words[2], words[3] = MAGIC, 2, 1 << 20, token()
                        del words
                    socket.send_fds(conn, [struct.pack("q", token())], [fake])
                    result["served"] += 1
                    conn.recv(100)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    tried = False
    while time.monotonic() < deadline:
        if not tried and os.path.exists(real_file):
            tried = True
            try:
                with open(real_file) as f:
                    sock = f.read().split("\t")[1]
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.settimeout(2)
                    c.connect(b"\0cpuddp-shm-" + sock.encode())
                    c.sendall(b"1")
                    _msg, fds, _f, _a = socket.recv_fds(c, 64, 1)
                    result["stolen_fds"] += len(fds)
            except (OSError, IndexError) as exc:
                result["steal_errors"].append(str(exc)[:100])
        time.sleep(0.01)
    os.unlink(path)
    with open(os.path.join(where, "user.json"), "w") as f:
        json.dump(result, f)


def store_role(host: str, port: int, seconds: float, where: str) -> None:
    import datetime

    import torch.distributed as dist

    deadline = time.monotonic() + seconds
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    open(os.path.join(where, "connected"), "w").close()
    fake_file = os.path.join(where, "fake.json")
    while not os.path.exists(fake_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(fake_file) as f:
        fake = json.load(f)
    writes, real, i = 0, None, 0
    while time.monotonic() < deadline:
        try:
            if real is None and store.check([KEY]):
                cur = store.get(KEY).decode(errors="replace")
                if fake["sock"] not in cur and fake["path"] not in cur:
                    real = cur
                    with open(os.path.join(where, "real.txt"), "w") as f:
                        f.write(real)
            token = real.split("\t")[2] if real else "1"
            value = f"sock\t{fake['sock']}\t{token}\t{1 << 20}" if i % 2 else f"{fake['path']}\t{token}\t{1 << 20}"
            store.set(KEY, value)
            writes += 1
            i += 1
        except Exception:  # noqa: BLE001 -- the job ended and took its store with it
            break
    with open(os.path.join(where, "store.json"), "w") as f:
        json.dump({"writes": writes, "saw_real_offer": real is not None}, f)


if __name__ == "__main__":
    if sys.argv[1] == "user":
        user_role(float(sys.argv[2]), sys.argv[3])
    else:
        store_role(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
