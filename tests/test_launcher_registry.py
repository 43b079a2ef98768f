"""register_launcher: a site's own scheduler, read like the built-in launchers.

The reader under test is the worked example of docs/launchers.md ("Adding a site launcher"),
taken from the page itself, so the page stays true: unit tests feed it mappings, and one
test starts two real ranks with the scheduler's variables and nothing else.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from cpuddp import LauncherEnvError
from cpuddp.launchers import registry as launchers
from cpuddp.launchers.env import Provenance, Source
from cpuddp.launchers import (
    LAUNCHER_NAMES,
    LauncherReader,
    PartialEnv,
    clean_environ,
    derive_port,
    detect,
    registered_launchers,
    register_launcher,
    unregister_launcher,
)

REPO = Path(__file__).resolve().parents[1]
BUILTIN = ["torchrun", "hydra", "pmix", "openmpi", "mvapich", "slurm", "env"]


def docs_example() -> str:
    """The ```python block under "## Adding a site launcher" in docs/launchers.md."""
    text = (REPO / "docs" / "launchers.md").read_text()
    section = text.split("## Adding a site launcher", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "docs/launchers.md lost its FooSched example"
    return m.group(1)


def _load_example() -> Any:
    """Run the docs example (it registers "foosched"); return its reader class."""
    ns: dict[str, Any] = {}
    exec(compile(docs_example(), "docs/launchers.md:foosched", "exec"), ns)
    return ns["FooSchedReader"]


@pytest.fixture
def registry() -> Iterator[None]:
    """Leave the registry as the test found it."""
    saved = registered_launchers()
    names = dict(LAUNCHER_NAMES)
    yield
    for name, _ in registered_launchers():
        unregister_launcher(name)
    for name, reader in saved:
        register_launcher(name, reader, before=None)
    LAUNCHER_NAMES.clear()
    LAUNCHER_NAMES.update(names)


@pytest.fixture
def foosched(registry: None) -> Any:
    return _load_example()


def order() -> list[str]:
    return [name for name, _ in registered_launchers()]


FOO_RANK3 = {"FOO_RANK": "3", "FOO_SIZE": "5", "FOO_PPN": "2", "FOO_HOSTS": "n01,n02,n03", "FOO_JOB": "77"}


def test_builtins_are_readers_named_in_messages():
    assert order() == BUILTIN == [name for name, _ in launchers.READERS]
    for name, reader in registered_launchers():
        assert isinstance(reader, LauncherReader)
        assert LAUNCHER_NAMES[name] == reader.description


def test_docs_example_registers_after_the_builtins_before_plain_variables(foosched):
    assert order() == BUILTIN[:-1] + ["foosched", "env"]
    assert LAUNCHER_NAMES["foosched"] == "FooSched (foorun)"
    env = detect(FOO_RANK3)
    assert (env.launcher, env.rank, env.world_size) == ("foosched", 3, 5)
    assert (env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (1, 2, 1, 3)
    assert env.master_addr == "n01"  # the first of the hosts, multi-node and no MASTER_ADDR
    assert env.master_port == derive_port("FOO_JOB=77")
    assert env.sources["rank"] == "FOO_RANK" and env.sources["rank"].kind is Source.VARIABLE
    assert env.sources["node_rank"].kind is Source.DERIVED
    assert env.sources["master_addr"] == "derived: first host of FOO_HOSTS"
    last = detect({**FOO_RANK3, "FOO_RANK": "4"})  # the last node has one task
    assert (last.local_rank, last.local_world_size, last.node_rank) == (0, 1, 2)
    unregister_launcher("foosched")
    assert order() == BUILTIN and "foosched" not in LAUNCHER_NAMES
    assert detect(FOO_RANK3).launcher == "none"


@pytest.mark.parametrize(
    "environ, variable, shown",
    [
        ({"FOO_RANK": "0"}, "FOO_SIZE", "unset"),
        ({"FOO_RANK": "x", "FOO_SIZE": "2", "FOO_PPN": "2"}, "FOO_RANK", "'x'"),
        ({"FOO_RANK": "2", "FOO_SIZE": "2", "FOO_PPN": "2"}, "FOO_RANK", "'2'"),  # the shared range check
        ({**FOO_RANK3, "PMI_RANK": "0", "PMI_SIZE": "5"}, "FOO_RANK", "'3'"),  # hydra first; FOO_RANK disagrees
    ],
)
def test_site_reader_errors_in_one_voice(foosched, environ, variable, shown):
    with pytest.raises(LauncherEnvError) as info:
        detect(environ)
    err = info.value
    assert err.variable == variable, str(err)
    assert str(err).splitlines()[-1].startswith(f"{variable}={shown}"), str(err)
    assert "FooSched" in str(err) or variable == "PMI_RANK", str(err)
    clone = pickle.loads(pickle.dumps(err))
    assert str(clone) == str(err)


def test_register_before_and_replace_in_place(foosched):
    reader = foosched()
    register_launcher("foosched", reader, before="torchrun", replace=True)
    assert order()[0] == "foosched"
    env = detect({**FOO_RANK3, "TORCHELASTIC_RUN_ID": "j", "RANK": "3", "WORLD_SIZE": "5", "LOCAL_RANK": "1"})
    assert env.launcher == "foosched"  # tried first now
    register_launcher("foosched", foosched, replace=True)  # a class is instantiated; same place
    assert order()[0] == "foosched" and dict(registered_launchers())["foosched"] is not reader
    register_launcher("foosched", reader, before=None, replace=True)
    assert order()[-1] == "foosched"


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (("Bad Name",), {}, ValueError, "not valid"),
        (("none",), {}, ValueError, "not valid"),
        (("hydra",), {}, ValueError, "already registered"),
        (("site",), {"before": "nosuch"}, ValueError, "not another registered launcher"),
        (("site",), {"before": "site"}, ValueError, "not another registered launcher"),
    ],
)
def test_register_rejects(registry, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        register_launcher(*args, LauncherReader(), **kwargs)
    assert order() == BUILTIN


def test_register_rejects_a_non_reader(registry):
    with pytest.raises(TypeError, match="LauncherReader"):
        register_launcher("site", object())  # type: ignore[arg-type]
    unregister_launcher("never-registered")  # no error when absent
    assert order() == BUILTIN


def test_a_plain_string_source_is_a_variable(registry):
    class Minimal(LauncherReader):
        description = "Minimal"

        def detect(self, environ):
            return "MIN_RANK" in environ

        def read(self, environ):
            v = self.variables(environ)
            return PartialEnv(rank=v.int("MIN_RANK"), world_size=1, sources={"rank": "MIN_RANK"})

    register_launcher("minimal", Minimal)
    env = detect({"MIN_RANK": "0"})
    assert env.launcher == "minimal" and env.sources["rank"] == Provenance.variable("MIN_RANK")
    assert env.sources["local_world_size"] == "derived: world of 1"


# --------------------------------------------------------------------------- two real ranks

RANK_SCRIPT = r'''
import json, os, sys
exec(compile(open(sys.argv[1]).read(), "foosched.py", "exec"))  # the docs example: registers foosched
import torch, torch.distributed as dist
import cpuddp
from cpuddp.distributed import get_session

env = cpuddp.init_distributed(backend="gloo", pin=False, timeout=60)
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[2], f"rank{env.rank}.json"), "w") as f:
    json.dump({"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
               "local_world_size": env.local_world_size, "launcher": env.launcher,
               "master": [env.master_addr, env.master_port], "sum": t.item(),
               "rank_source": env.sources["rank"], "backend": get_session().backend,
               "exported_rank": os.environ.get("RANK")}, f)
cpuddp.shutdown()
'''


@pytest.mark.timeout(180)
def test_two_real_ranks_under_the_site_launcher(tmp_path):
    example = tmp_path / "foosched.py"
    example.write_text(docs_example())
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    job = f"test-{uuid.uuid4().hex}"
    base = clean_environ(os.environ)  # no other launcher's variables: FooSched's only
    base.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = []
    for rank in range(2):
        env = {**base, "FOO_RANK": str(rank), "FOO_SIZE": "2", "FOO_PPN": "2", "FOO_HOSTS": "localhost",
               "FOO_JOB": job}
        procs.append(subprocess.Popen([sys.executable, str(script), str(example), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = []
    deadline = time.monotonic() + 150
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out = p.communicate()[0] + "\n[killed: no exit within 150 s]"
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    shown = "\n".join(f"--- rank {r} (exit {p.returncode}):\n{o[-3000:]}"
                      for r, (p, o) in enumerate(zip(procs, outputs)))
    assert [p.returncode for p in procs] == [0, 0], shown
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    port = derive_port(f"FOO_JOB={job}")
    for r, row in enumerate(rows):
        assert row == {"rank": r, "world_size": 2, "local_rank": r, "local_world_size": 2, "launcher": "foosched",
                       "master": ["127.0.0.1", port], "sum": 3.0, "rank_source": "FOO_RANK", "backend": "gloo",
                       "exported_rank": str(r)}, shown
