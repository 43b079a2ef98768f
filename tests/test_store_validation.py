"""Every value cpuddp reads from the rendezvous store outside the shm segment code is checked
(issue 22, item 2): host records and the layout, backend agreement, the job key.  A malformed
or hostile value -- wrong type, absurd size, not a number, wrong field count, a rank outside
the world, a negative CPU -- is a RendezvousError naming the key and what was wrong, with the
fix; never a crash deep inside, never a silent default.  Pure functions over tables, plus the
callers fed a real (in-process) store holding the hostile values.  The watchdog's keys are in
tests/test_watchdog_verdict.py."""

from __future__ import annotations

import datetime
import json
import socket
import time

import pytest
import torch.distributed as dist

from cpuddp.launchers import hosts
from cpuddp.launchers import store_values
from cpuddp.backends.agreement import agree_backend
from cpuddp.backends.registry import resolve_backend
from cpuddp.launchers.env import DistEnv
from cpuddp.errors import RendezvousError
from cpuddp.launchers.rendezvous import JOB_KEY, _is_ours, _job_of, _join_job, job_key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TD = datetime.timedelta(seconds=2)
KEY = "cpuddp/init0/host/1"


def _record(**change) -> str:
    d = {"rank": 1, "host": "node7|boot|42", "cpus": [2, 3], "local_rank": 1, "local_size": 2}
    d.update(change)
    return json.dumps(d)


def _refused(fn, *args, what: str) -> str:
    with pytest.raises(RendezvousError) as info:
        fn(*args)
    msg = str(info.value)
    assert what in msg, msg
    assert "docs/security.md" in (info.value.fix or ""), info.value.fix
    return msg


# --------------------------------------------------------------------------- host records


def test_a_good_record_and_launcher_silence():
    assert hosts.parse_record(KEY, _record().encode(), 1, 4) == hosts.HostRecord(1, "node7|boot|42", (2, 3), 1, 2)
    silent = hosts.parse_record(KEY, _record(local_rank=None, local_size=None, cpus=[]), 1, 4)
    assert silent.local_rank is None and silent.local_size is None and silent.cpus == ()
    rec = hosts.HostRecord(3, "n|b|1", (0, 5), None, None)
    assert hosts.parse_record("k", rec.to_json(), 3, 4) == rec  # what a rank writes, it reads back


@pytest.mark.parametrize("raw, what", [
    (b"\xff\xfe", "not UTF-8 text"),
    (b"x" * (store_values.MAX_VALUE + 1), "more than the 1048576 allowed"),
    ("not json", "not JSON"),
    ('"a string"', "a JSON str, not an object"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"rank": 1}', "the wrong fields (missing ['cpus', 'host', 'local_rank', 'local_size'])"),
    (_record()[:-1] + ', "extra": 1}', "the wrong fields (unexpected [\"'extra'\"])"),
    ("[" * 100_000, "not JSON"),  # deep nesting: no RecursionError escapes
    (_record(rank=2), "its rank 2 is not 1, the rank of its key"),
    (_record(rank=9), "its rank 9 is outside 0..3"),
    (_record(rank="1"), "its rank '1' is not a whole number"),  # a JSON number, not text
    (_record(cpus=["3"]), "its CPU number '3' is not a whole number"),
    (_record(rank=True), "its rank True is not a whole number"),
    (_record(rank=1.5), "its rank 1.5 is not a whole number"),
    (_record(host=""), "its host '' is not printable text"),
    (_record(host=7), "its host 7 is not printable text"),
    (_record(host="a\x1b[2Jb"), "is not printable text"),
    (_record(host="h" * 5000), "is not printable text of 1..4096 characters"),
    (_record(cpus="0-3"), "its cpus are not a list"),
    (_record(cpus=list(range(70_000))), "its cpus are not a list of at most 65536"),
    (_record(cpus=[-1]), "its CPU number -1 is outside 0..65535"),
    (_record(cpus=[1 << 40]), "its CPU number 1099511627776 is outside"),
    (_record(cpus=["x"]), "its CPU number 'x' is not a whole number"),
    (_record(cpus=[1, 1]), "its cpus repeat a CPU"),
    (_record(local_size=0), "its local_size 0 is outside 1..4"),
    (_record(local_size=5), "its local_size 5 is outside 1..4"),
    (_record(local_rank=2), "its local_rank 2 is outside 0..1"),
    (_record(local_rank=-1, local_size=None), "its local_rank -1 is outside 0..3"),
])
def test_malformed_records_are_refused_naming_the_key(raw, what):
    msg = _refused(hosts.parse_record, KEY, raw, 1, 4, what=what)
    assert msg.startswith(f"store key {KEY} holds ")
    assert len(msg) < 1200  # a huge value is shown shortened


@pytest.mark.parametrize("ranks", [[0, 1, 1], [0, 2], [1, 2, 3], []])
def test_records_must_be_each_rank_once(ranks):
    recs = [hosts.HostRecord(r, "h", ()) for r in ranks]
    _refused(hosts.check_records, recs, 3, what="not each rank of 0..2 once")


def test_layout_refuses_records_without_this_rank():
    recs = [hosts.HostRecord(0, "h", ()), hosts.HostRecord(1, "h", ())]
    _refused(hosts.layout, recs, 2, what="rank 2 is not a rank of the 2 host records")
    _refused(hosts.layout, recs[:1] + recs[:1], 0, what="not each rank of 0..1 once")


def test_gather_hosts_refuses_a_hostile_record_in_the_store():
    store = dist.HashStore()
    store.set("h/1", _record(cpus=[-4]))  # "rank 1" published a negative CPU
    mine = hosts.HostRecord(0, "node7|boot|42", (0, 1), 0, 2)
    _refused(hosts.gather_hosts, store, "h", mine, 2, TD, what="store key h/1 holds")


def test_exchange_refuses_bytes_that_are_not_text_and_cleans_peer_errors():
    store = dist.HashStore()
    store.set("x/1", b"\xc3\x28")
    _refused(hosts.exchange, store, "x", 0, 2, "v", TD, what="store key x/1 holds b'\\xc3(': not UTF-8 text")
    store = dist.HashStore()
    store.set("y/1", "!ValueError: \x1b]0;pwned\x07" + "z" * 5000)
    with pytest.raises(RendezvousError) as info:
        hosts.exchange(store, "y", 0, 2, "v", TD)
    msg = info.value.msg
    assert "\x1b" not in msg and "\x07" not in msg and len(msg) < 600


# --------------------------------------------------------------------------- backend agreement


@pytest.mark.parametrize("raw, what", [
    (b"gloo", ""), (b"my_backend2", ""),
    (b"", "not a backend name"), (b"GLOO", "not a backend name"), (b"gl oo", "not a backend name"),
    (b"x" * 65, "not a backend name"), (b"x" * 300, "more than the 256 allowed"),
    (b"\xff", "not UTF-8"), (b"gloo\x00", "a NUL character"),
])
def test_backend_names(raw, what):
    if not what:
        assert store_values.backend_name("b/1", raw) == raw.decode()
    else:
        _refused(store_values.backend_name, "b/1", raw, what=what)


def test_agree_backend_refuses_a_hostile_choice_naming_the_key():
    store = dist.HashStore()
    store.set("agree/1", "gloo; rm -rf /")
    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2)
    _refused(agree_backend, resolve_backend("gloo", env, environ={}), "gloo", env, hosts.sharing(store, 0, 2, TD), "agree",
             what="store key agree/1 holds 'gloo; rm -rf /'")


# --------------------------------------------------------------------------- the job key


@pytest.mark.parametrize("raw, what", [
    (b"slurm-42/w2", ""), (b"", "empty or holding non-printable"), (b"a\nb", "non-printable"),
    (b"k" * 2000, "more than the 1024 allowed"), (b"\xff", "not UTF-8"),
])
def test_job_key_values(raw, what):
    if not what:
        assert store_values.job_key_value(JOB_KEY, raw) == raw.decode()
    else:
        _refused(store_values.job_key_value, JOB_KEY, raw, what=what)


def test_a_rank_refuses_a_malformed_job_key():
    store = dist.HashStore()
    env = DistEnv(rank=1, world_size=2, job_id="42", launcher="env")
    store.set(JOB_KEY, b"\x00" * 10)
    _refused(_job_of, store, "127.0.0.1", 29500, TD, what=f"store key {JOB_KEY} (at 127.0.0.1:")
    with pytest.raises(RendezvousError, match="reached the store of another job .*its job 'other-job/w2'"):
        _is_ours(env, "other-job/w2", job_key(env), 1)
    assert _is_ours(env, f"{job_key(env)} init2", job_key(env), 2)  # ours: accepted
    assert not _is_ours(env, f"{job_key(env)} init1", job_key(env), 2)  # the previous init's: dial again
    assert not _is_ours(env, None, job_key(env), 2)


def test_a_rank_that_reaches_the_previous_inits_store_dials_again_until_the_new_one_answers():
    """init -> shutdown -> init under an MPI launcher: rank 1 may re-join before rank 0 has torn
    down the first init's store (the CI failure of round 4)."""
    import threading
    from datetime import timedelta

    from cpuddp.launchers.rendezvous import _init_key

    env = DistEnv(rank=1, world_size=2, job_id="42", launcher="env", master_addr="127.0.0.1", master_port=_free_port())
    key = job_key(env)
    old = dist.TCPStore("127.0.0.1", env.master_port, 2, True, timedelta(seconds=10), wait_for_workers=False)
    old.set(JOB_KEY, _init_key(key, 1))
    new: list = []

    def rank0_moves_on() -> None:
        time.sleep(1.0)
        old_server = stores.pop()
        del old_server
        store = dist.TCPStore("127.0.0.1", env.master_port, 2, True, timedelta(seconds=10), wait_for_workers=False)
        store.set(JOB_KEY, _init_key(key, 2))
        new.append(store)

    stores = [old]
    del old
    mover = threading.Thread(target=rank0_moves_on)
    mover.start()
    try:
        client = _join_job(env, key, 2, timedelta(seconds=20))
        assert client.get(JOB_KEY).decode() == _init_key(key, 2)
    finally:
        mover.join()
    with pytest.raises(RendezvousError, match="(?s)still on another init of this job .*init_distributed\\(\\) and shutdown\\(\\)"):
        _join_job(env, key, 3, timedelta(seconds=2))


def test_job_keys_are_always_acceptable():
    for job in ("42", "x" * 5000, "tab\there", None):
        env = DistEnv(rank=1, world_size=2, job_id=job, launcher="env")
        assert store_values.job_key_value(JOB_KEY, job_key(env).encode()) == job_key(env)


# --------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("value, lo, hi, ok", [
    (3, 0, 4, True), ("3", 0, 4, True), ("03", 0, 4, True), (4, 0, 4, False), (-1, 0, 4, False),
    ("-1", 0, 4, False), ("1e3", 0, 9999, False), ("１", 0, 4, False), ("9" * 30, 0, 4, False),
    (None, 0, 4, False), (2.0, 0, 4, False), (False, 0, 4, False), ([1], 0, 4, False),
])
def test_int_field(value, lo, hi, ok):
    if ok:
        assert store_values.int_field("k", "n", value, lo, hi) == int(value)
    else:
        with pytest.raises(RendezvousError, match="store key k holds .*its n "):
            store_values.int_field("k", "n", value, lo, hi)


def test_text_value_refuses_other_types():
    _refused(store_values.text_value, "k", 12, what="a int, not bytes")


# --------------------------------------------------------------------------- the watchdog, on a real store


class _Env:
    def __init__(self, rank: int, world: int, port: int) -> None:
        self.rank, self.world_size, self.master_addr, self.master_port = rank, world, "127.0.0.1", port
        self.agent_store = False


@pytest.mark.timeout(60)
def test_the_watchdog_names_a_hostile_key_and_keeps_beating(monkeypatch):
    """A real TCPStore whose watchdog keys hold what no rank writes: the watchdog keeps its
    heartbeat, and its verdict says which key is malformed -- not "the store is gone"."""
    import socket
    import time

    from cpuddp.watchdog import monitor as watchdog

    monkeypatch.delenv("CPUDDP_WATCHDOG", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    try:
        server.append("cpuddp/watchdog/0/info", "0\tnot-a-pid\tnode7\tid\n")  # written before rank 1 starts
        server.set("cpuddp/watchdog/0/hb/0", "lots")
        watchdog.start(_Env(1, 2, port), server, interval=0.1)
        assert watchdog.running()
        first = int(server.get("cpuddp/watchdog/0/hb/1"))
        time.sleep(0.6)
        assert int(server.get("cpuddp/watchdog/0/hb/1")) > first  # still beating
        verdict = watchdog.diagnose(comm_failure=True) or ""
        assert verdict.startswith("cpuddp: [rank1] the watchdog cannot name a lost rank: store key "
                                  "cpuddp/watchdog/0/info holds '0\\tnot-a-pid"), verdict
        assert "its pid 'not-a-pid' is not a whole number" in verdict and "docs/security.md" in verdict
        assert "store" in verdict and "is gone" not in verdict
    finally:
        watchdog.stop()
        del server
