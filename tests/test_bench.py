"""Pure parts of ``cpuddp bench``: sizes, bandwidth factors, table, summary, exit codes, the ranks' env.

The multi-process runs (``--nproc 2``) are in tests/test_cli.py.
"""

from __future__ import annotations

import argparse
import csv
import io

import pytest

from cpuddp.bench import report as bench_report
from cpuddp import _procs
from cpuddp.bench import cli as bench_cli
from cpuddp.bench import launch as bench_launch
from cpuddp.bench import rank as bench_rank
from cpuddp.bench import sweep as bench_sweep
from cpuddp._units import format_size, parse_size
from cpuddp.bench.report import format_row, format_rows, rows_to_csv
from cpuddp.bench.sweep import (
    EXIT_BELOW_MIN,
    EXIT_OK,
    EXIT_WRONG,
    bus_factor,
    exit_code,
    make_row,
    shape_size,
    shaped_sizes,
    summarize,
    sweep_sizes,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8", 8),
        ("1K", 1024),
        ("1k", 1024),
        ("1KiB", 1024),
        ("64M", 64 << 20),
        ("64MB", 64 << 20),
        ("1G", 1 << 30),
        ("0.5K", 512),
        (" 16 M ", 16 << 20),
        ("4B", 4),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "K", "0", "-1K", "1T", "abc", "0.3", "1.5B"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_size() -> None:
    assert [format_size(n) for n in (0, 1000, 1024, 1536, 1 << 20, 3 << 30)] == [
        "0 B", "1000 B", "1 KiB", "1.5 KiB", "1 MiB", "3 GiB"]


def test_sweep_sizes() -> None:
    assert sweep_sizes(1024, 64 << 20, 4) == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22,
                                              1 << 24, 1 << 26]
    assert sweep_sizes(8, 8, 2) == [8]
    assert sweep_sizes(8, 100, 2) == [8, 16, 32, 64]  # stops below --max when it is not reached exactly
    with pytest.raises(ValueError, match="--factor"):
        sweep_sizes(8, 16, 1)
    with pytest.raises(ValueError, match="--min"):
        sweep_sizes(16, 8, 2)


@pytest.mark.parametrize(
    "collective, n, factor",
    [
        ("allreduce", 2, 1.0),
        ("allreduce", 4, 1.5),
        ("allreduce", 8, 1.75),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 2, 0.5),
        ("broadcast", 8, 1.0),
        ("allreduce", 1, 1.0),
    ],
)
def test_bus_factor_matches_nccl_tests(collective: str, n: int, factor: float) -> None:
    assert bus_factor(collective, n) == pytest.approx(factor)


def test_bus_factor_unknown() -> None:
    with pytest.raises(ValueError, match="allreduce"):
        bus_factor("alltoall", 2)


def test_shape_size_rounds_to_whole_chunks() -> None:
    assert shape_size(1024, "allreduce", 3, 4) == (1024, 256)
    assert shape_size(1000, "all_gather", 3, 4) == (996, 249)  # 83 float32 per rank
    assert shape_size(4, "reduce_scatter", 4, 4) == (16, 4)  # at least one element per rank
    assert shape_size(1, "allreduce", 2, 8) == (8, 1)


def test_shaped_sizes_drop_repeats_after_rounding() -> None:
    # 8 and 16 bytes both round up to one float32 per rank of 4 for all_gather: one row, not two
    assert shaped_sizes(8, 32, 2, "all_gather", 4, 4) == [(16, 4), (32, 8)]
    assert shaped_sizes(1024, 4096, 2, "allreduce", 2, 4) == [(1024, 256), (2048, 512), (4096, 1024)]


def test_make_row_bandwidths() -> None:
    row = make_row("allreduce", 2, 16 << 20, 4 << 20, "float32", 0.016, wrong=0, inplace=True)
    assert row.algbw == pytest.approx((16 << 20) / 1e9 / 0.016)
    assert row.busbw == pytest.approx(row.algbw)  # 2(n-1)/n = 1 for n = 2
    assert row.time_us == pytest.approx(16000)
    assert (row.redop, row.root) == ("sum", -1)
    b = make_row("broadcast", 4, 1024, 256, "float32", 1e-3, wrong=0, inplace=True)
    assert (b.redop, b.root) == ("none", 0)


def test_table_lines_align_and_comment_header() -> None:
    rows = [make_row("allreduce", 2, s, s // 4, "float32", 1e-4 * (i + 1), 0, True)
            for i, s in enumerate((1024, 1 << 26))]
    lines = format_rows(rows)
    assert all(line.startswith("#") for line in lines[:2])
    assert len({len(line) for line in lines[2:]}) == 1
    # Each column's right edge lines up with the header's.
    head, data = lines[0], lines[2]
    for word in ("size", "count", "type", "time", "algbw", "busbw", "#wrong"):
        end = head.index(word) + len(word)
        assert data[end - 1] != " ", (word, head, data)
    assert format_row(make_row("allreduce", 2, 8, 2, "float32", 1e-3, -1, True)).endswith("N/A")


def test_summary_and_exit_codes() -> None:
    rows = [make_row("allreduce", 2, 1 << 20, 1 << 18, "float32", t, 0, True) for t in (1e-3, 2e-3)]
    s = summarize(rows, min_busbw=None, ceiling_gbps=10.0)
    assert s["exit_code"] == EXIT_OK
    assert s["avg_busbw"] == pytest.approx(((1 << 20) / 1e6 + (1 << 20) / 2e6) / 2)
    assert s["peak_fraction_of_ceiling"] == pytest.approx(s["peak_busbw"] / 10.0)
    assert summarize(rows, min_busbw=1e9)["exit_code"] == EXIT_BELOW_MIN
    assert summarize(rows, min_busbw=0.0)["exit_code"] == EXIT_OK
    rows[0].wrong = 3
    assert summarize(rows, min_busbw=1e9)["exit_code"] == EXIT_WRONG  # wrong results win
    assert exit_code(0, 1.0, None) == EXIT_OK
    text = "\n".join(bench_report.format_summary(summarize(rows, min_busbw=1e9)))
    assert "FAILED" in text and all(line.startswith("#") for line in text.splitlines())


def test_csv_round_trip() -> None:
    rows = [make_row("all_gather", 2, 1024, 256, "bfloat16", 1e-4, 0, False)]
    parsed = list(csv.DictReader(io.StringIO(rows_to_csv(rows))))
    assert parsed[0]["size"] == "1024" and parsed[0]["type"] == "bfloat16"
    assert float(parsed[0]["busbw_gbps"]) == pytest.approx(rows[0].busbw, rel=1e-5)
    assert parsed[0]["inplace"] == "0"


def test_rank_environment_strips_other_launchers() -> None:
    parent = {"PATH": "/bin", "PMI_RANK": "3", "OMPI_COMM_WORLD_RANK": "1", "SLURM_PROCID": "0",
              "RANK": "5", "MASTER_ADDR": "10.0.0.1", "OMP_NUM_THREADS": "4", "TORCHELASTIC_RUN_ID": "x",
              "CCL_WORKER_COUNT": "2", "GLOO_SOCKET_IFNAME": "eth0"}
    base = _procs.world_environ(parent, 2, 29555, extra={bench_launch.CHILD_MARK: "1"})
    assert base["WORLD_SIZE"] == "2" and base["LOCAL_WORLD_SIZE"] == "2"
    assert base["MASTER_ADDR"] == "127.0.0.1" and base["MASTER_PORT"] == "29555"
    assert base["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the parent hosts the store
    assert base["OMP_NUM_THREADS"] == "4" and base["PATH"] == "/bin"
    assert base["CCL_WORKER_COUNT"] == "2" and base["GLOO_SOCKET_IFNAME"] == "eth0"  # bench keeps backend settings
    for gone in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "TORCHELASTIC_RUN_ID", "RANK"):
        assert gone not in base
    assert base[bench_launch.CHILD_MARK] == "1"
    assert parent["RANK"] == "5"  # the parent's mapping is untouched
    assert base["PYTHONWARNINGS"] == _procs.NUMPY_WARNING_FILTER  # torch's numpy warning: the parent's copy only
    own = _procs.world_environ({**parent, "PYTHONWARNINGS": "error::DeprecationWarning"}, 2, 29555)
    assert own["PYTHONWARNINGS"] == "error::DeprecationWarning," + _procs.NUMPY_WARNING_FILTER
    tests_env = _procs.world_environ(parent, 2, 29555, strip_backend_settings=True)
    assert "CCL_WORKER_COUNT" not in tests_env and "GLOO_SOCKET_IFNAME" not in tests_env
    with pytest.raises(ValueError, match="MASTER_PORT"):
        _procs.world_environ(parent, 2, 29555, extra={"MASTER_PORT": "1"})


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_arguments_aliases_and_defaults() -> None:
    a = _parse("all_reduce", "-b", "1K", "-e", "4M", "-f", "4", "-d", "bf16", "-n", "3", "-w", "1")
    assert (a.collective, a.min, a.max, a.factor, a.dtype, a.iters, a.warmup) == (
        "allreduce", 1024, 4 << 20, 4.0, "bfloat16", 3, 1)
    assert _parse("allgather").collective == "all_gather"
    assert _parse("reducescatter").collective == "reduce_scatter"
    d = _parse("broadcast")
    assert d.check and d.pin and d.ceiling and d.nproc is None and d.min_busbw is None


@pytest.mark.parametrize("argv", [["allscatter"], ["allreduce", "-b", "1X"], ["allreduce", "-d", "complex64"]])
def test_arguments_reject(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(*argv)
    assert e.value.code == 2


def test_run_rejects_bad_values_with_usage_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cli.run(_parse("allreduce", "-n", "0"), []) == bench_sweep.EXIT_USAGE
    assert bench_cli.run(_parse("allreduce", "-b", "2M", "-e", "1M"), []) == bench_sweep.EXIT_USAGE
    assert "--min" in capsys.readouterr().err


def test_header_lines_name_backend_threads_and_versions() -> None:
    meta = {
        "collective": "allreduce", "nranks": 2, "nodes": 1, "launcher": "env", "backend": "gloo",
        "versions": {"cpuddp": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11.7", "oneccl_bind_pt": None,
                     "ipex": None},
        "min": 1024, "max": 4096, "factor": 2.0, "warmup": 1, "iters": 2, "dtype": "float32", "inplace": True,
        "check": True, "pin": True, "pin_plan": "CPUs 0, 1 thread(s)",
        "ranks": [{"host": "vm", "pid": 1, "cpus": "0", "torch_threads": 1, "OMP_NUM_THREADS": "1"}] * 10,
        "ceiling": {"gbps": 9.5, "bytes": 1 << 28, "threads": 1, "reps": 5, "min_gbps": 9.0, "max_gbps": 10.0},
    }
    lines = bench_report.header_lines(meta)
    text = "\n".join(lines)
    assert all(line.startswith("#") for line in lines)
    for needle in ("backend: gloo", "torch 2.13.0+cpu", "torch threads 1", "OMP_NUM_THREADS=1", "plan: CPUs 0, 1 thread(s)",
                   "9.50 GB/s", "2 more ranks", "in-place", "max over ranks"):
        assert needle in text, needle


def test_header_and_comparison_name_the_data_path_measured() -> None:
    """`cpuddp bench` never said which data path it measured: shm's in the job header's words
    (native and its width, or Python and why), another backend's by its name."""
    meta = {
        "collective": "allreduce", "nranks": 2, "nodes": 1, "launcher": "env", "backend": "shm",
        "data_path": "native data path, avx2",
        "versions": {"cpuddp": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11.7"},
        "min": 1024, "max": 4096, "factor": 2.0, "warmup": 1, "iters": 2, "dtype": "float32", "inplace": True,
        "check": True, "pin": True, "ranks": [], "ceiling": None,
    }
    assert "# backend: shm (native data path, avx2)" in bench_report.header_lines(meta)
    gloo = dict(meta, backend="gloo", data_path="gloo")
    assert "# backend: gloo" in bench_report.header_lines(gloo)
    line = bench_report.data_paths_line({"gloo": "gloo", "shm": "Python data path: CPUDDP_SHM_NATIVE=0"})
    assert line == "# data paths: gloo; shm (Python data path: CPUDDP_SHM_NATIVE=0)"


# --------------------------------------------------------------------------- several backends in one run


def test_backend_list_parses_in_order_and_rejects_repeats_and_blanks(capsys: pytest.CaptureFixture[str]) -> None:
    assert _parse("allreduce").backend == ["auto"]
    assert _parse("allreduce", "--backend", "Gloo, shm").backend == ["gloo", "shm"]
    for bad in ("gloo,gloo", "gloo,", ""):
        with pytest.raises(SystemExit):
            _parse("allreduce", "--backend", bad)


def test_compare_bare_is_gone_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parse("allreduce", "--compare-bare")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--compare-bare was removed" in err and "--backend a,b" in err


def _row(backend_time_us: float, size: int = 1 << 20) -> bench_sweep.Row:
    return make_row("allreduce", 2, size, size // 4, "float32", backend_time_us / 1e6, 0, True)


def test_backend_rows_give_the_speed_up_of_each_backend_over_the_first_and_align() -> None:
    names = ["gloo", "shm", "ccl"]
    rows = {"gloo": _row(2000.0), "shm": _row(500.0), "ccl": _row(4000.0)}
    row = bench_sweep.backend_row(names, rows, {b: [rows[b].time_us / 1e6] for b in names})
    assert row["ratio"] == {"shm": 4.0, "ccl": 0.5}
    assert row["backends"]["shm"]["busbw"] == pytest.approx(rows["shm"].busbw)
    head = bench_report.format_backend_head(names)
    line = bench_report.format_backend_row(row, names)
    assert all(h.startswith("#") for h in head)
    assert len(line) == len(head[0]) == len(head[1])
    assert "4.00x" in line and line.endswith("0.50x")
    assert "shm/gloo" in head[0] and "ccl/gloo" in head[0]


def _exchange():
    import torch.distributed as dist

    return bench_rank.exchange_json({"rank": dist.get_rank(), "text": "é" * (dist.get_rank() + 1)})


@pytest.mark.slow
def test_exchange_json_gathers_every_ranks_value_in_order_without_object_collectives() -> None:
    from cpuddp.testing import run_distributed

    want = [{"rank": 0, "text": "é"}, {"rank": 1, "text": "éé"}]
    assert run_distributed(_exchange, 2, timeout=120) == [want, want]
    import inspect

    for fn in (bench_rank.run_rank, bench_rank._run_rank, bench_rank._meta, bench_rank._sweep,
               bench_rank._compare_backends):
        assert "all_gather_object" not in inspect.getsource(fn), fn.__name__


def test_bounded_teardown_abandons_a_call_that_hangs(capsys: pytest.CaptureFixture[str]) -> None:
    import threading
    import time

    release = threading.Event()
    start = time.monotonic()
    assert bench_rank._bounded(lambda: release.wait(30), 0.2, "destroy_process_group") is False
    assert time.monotonic() - start < 5
    release.set()
    assert "destroy_process_group did not return within 0.2 s" in capsys.readouterr().err
    assert bench_rank._bounded(lambda: None, 5, "x") is True


_NUMPY_PARENT = """
import sys
import torch  # where numpy is missing torch warns here, once: this process's copy
from cpuddp import _procs
with _procs.LocalWorld(2, 60) as world:
    for r in range(2):
        _procs.start_command(world, r, [sys.executable, "-c", "import torch"])
    exits = _procs.wait_exit_codes(world.procs, 60, 5)
sys.exit(1 if any(c != 0 for c in exits.codes) else 0)
"""


@pytest.mark.timeout(180)
def test_ranks_started_here_do_not_repeat_torchs_numpy_warning(tmp_path) -> None:
    """issue 46: "Failed to initialize NumPy" was said by every process; the parent says it once."""
    import os
    import subprocess
    import sys

    from example_util import fake_missing_numpy

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [fake_missing_numpy(tmp_path),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _NUMPY_PARENT], capture_output=True, text=True, timeout=150,
                          env=env, cwd=tmp_path)
    log = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    assert proc.stderr.count("Failed to initialize NumPy") == 1, log
