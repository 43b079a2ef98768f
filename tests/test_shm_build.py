"""The shm engine's native build: the compiler command, the build record, reuse, the reason the
Python path runs, the wheel tag read from the library's ELF, and the vector code compiled.

The pure parts (the tag, the ELF reader, the record's reasons) are tested on data; a few tests
compile ``engine.c`` for real (a wrapper compiler with arguments, a failing one, clang where it is
installed).  CI builds the release wheels and checks them: .ci/wheels.sh.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cpuddp.backends.shm import native
from cpuddp.backends.shm.native import build as nb
from cpuddp.backends.shm.native import elf

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the wheel's tag


def _needs(machine="x86_64", libraries=("libc.so.6", "libpthread.so.0"), **versions):
    return elf.Needs(machine, tuple(libraries), {lib: tuple(v) for lib, v in versions.items()} or
                     {"libc.so.6": ("GLIBC_2.2.5", "GLIBC_2.17")})


def test_the_tag_is_the_newest_glibc_the_library_needs_never_older_than_2_17():
    assert elf.platform_tag(_needs()) == "manylinux_2_17_x86_64.manylinux2014_x86_64"
    assert elf.platform_tag(_needs("aarch64")) == "manylinux_2_17_aarch64.manylinux2014_aarch64"
    newer = _needs(**{"libc.so.6": ("GLIBC_2.2.5", "GLIBC_2.34", "GLIBC_2.32", "GLIBC_2.4")})
    assert elf.glibc_needed(newer) == (2, 34)
    assert elf.platform_tag(newer) == "manylinux_2_34_x86_64"
    assert elf.platform_tag(_needs(**{"libc.so.6": ("GLIBC_2.3",)})) == "manylinux_2_17_x86_64.manylinux2014_x86_64"


def test_a_library_that_needs_more_than_glibc_gets_no_manylinux_tag():
    assert elf.platform_tag(_needs(libraries=("libc.so.6", "libasan.so.8"))) == "linux_x86_64"
    assert elf.platform_tag(_needs(**{"libc.so.6": ("GLIBC_2.17", "GLIBC_PRIVATE")})) == "linux_x86_64"
    assert elf.platform_tag(_needs("aarch64", libraries=("libc.musl-aarch64.so.1",))) == "linux_aarch64"


def _elf(machine: int, needed: list, versions: dict) -> bytes:
    """A minimal little-endian ELF64 shared object: a string table, .dynamic, .gnu.version_r."""
    strings = b"\0"
    at = {}
    for name in [*needed, *versions, *(v for vs in versions.values() for v in vs)]:
        if name not in at:
            at[name], strings = len(strings), strings + name.encode() + b"\0"
    dynamic = b"".join(struct.pack("<qQ", 1, at[lib]) for lib in needed) + struct.pack("<qQ", 0, 0)
    verneed = b""
    for i, (lib, names) in enumerate(versions.items()):
        nxt = 0 if i == len(versions) - 1 else 16 + 16 * len(names)
        verneed += struct.pack("<HHIII", 1, len(names), at[lib], 16, nxt)
        for j, name in enumerate(names):
            verneed += struct.pack("<IHHII", 0, 0, 2 + j, at[name], 16 if j < len(names) - 1 else 0)
    body = [(0, b"", 0), (3, strings, 0), (6, dynamic, 1), (0x6FFFFFFE, verneed, 1)]
    offset, blobs, headers = 64, b"", b""
    for kind, blob, link in body:
        headers += struct.pack("<IIQQQQIIQQ", 0, kind, 0, 0, offset if blob else 0, len(blob), link, 0, 8, 0)
        blobs, offset = blobs + blob, offset + len(blob)
    ident = b"\x7fELF\x02\x01\x01" + b"\0" * 9
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, 0, offset, 0, 64, 0, 0, 64, len(body), 0)
    return header + blobs + headers


def test_the_elf_reader_reads_machine_libraries_and_versions():
    data = _elf(183, ["libc.so.6", "libpthread.so.0"],
                {"libc.so.6": ["GLIBC_2.17", "GLIBC_2.28"], "libpthread.so.0": ["GLIBC_2.17"]})
    needs = elf.read(data)
    assert needs == elf.Needs("aarch64", ("libc.so.6", "libpthread.so.0"),
                              {"libc.so.6": ("GLIBC_2.17", "GLIBC_2.28"), "libpthread.so.0": ("GLIBC_2.17",)})
    assert elf.platform_tag(needs) == "manylinux_2_28_aarch64"
    with pytest.raises(ValueError, match="not an ELF file"):
        elf.read(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="machine 40"):
        elf.read(_elf(40, [], {}))


def test_the_elf_reader_agrees_with_objdump_on_the_built_library():
    path = Path(nb.HERE) / nb.LIB_NAME
    if not path.exists() or shutil.which("objdump") is None:
        pytest.skip("no built library or no objdump here")
    needs = elf.read_file(str(path))
    dump = subprocess.run(["objdump", "-p", str(path)], capture_output=True, text=True, check=True).stdout
    assert [line.split()[1] for line in dump.splitlines() if line.strip().startswith("NEEDED")] == \
        list(needs.libraries)
    versions = {line.split()[-1] for line in dump.splitlines() if "GLIBC_" in line}
    assert versions == {v for vs in needs.versions.values() for v in vs}
    assert needs.machine == os.uname().machine


# --------------------------------------------------------------------------- the record and its reasons


def test_the_first_error_line_is_the_one_to_read():
    out = "engine.c: In function 'f':\nengine.c:3:5: warning: unused\nengine.c:9:1: error: expected ';'\nmore\n"
    assert nb.first_error(out, 1) == "engine.c:9:1: error: expected ';'"
    assert nb.first_error("ld: cannot find -lpthread\n", 1) == "ld: cannot find -lpthread"
    assert nb.first_error("", 1) == "it exited with status 1 and printed nothing"


def test_a_library_is_reused_only_when_its_record_matches_the_build_and_its_bytes():
    record = {"ok": True, "key": "k1", "library": "sha"}
    assert nb.reusable(record, "k1", "sha")
    assert not nb.reusable(record, "k2", "sha")  # other sources, compiler or flags
    assert not nb.reusable(record, "k1", "other")  # the library was replaced
    assert not nb.reusable({**record, "ok": False}, "k1", "sha") and not nb.reusable(None, "k1", "sha")


def test_the_reason_says_what_happened():
    gcc = ["/usr/bin/gcc"]
    assert "never installed by pip" in nb.explain(None, gcc)
    none = {"ok": False, "reason": nb.NO_COMPILER, "error": "CC is unset and none of cc, gcc, clang is on PATH"}
    assert nb.explain(none, None).startswith("pip install found no C compiler (CC is unset")
    cached = nb.explain(none, gcc)
    assert "/usr/bin/gcc is here now" in cached and "pip's cache" in cached and "--no-cache-dir" in cached
    bad_cc = {"ok": False, "reason": nb.BAD_CC, "error": "CC='ccache gcc': 'ccache' is no program on PATH"}
    bad = nb.explain(bad_cc, gcc)
    assert bad.startswith("the native build could not start: CC='ccache gcc'")
    failed = nb.explain({"ok": False, "reason": nb.FAILED, "compiler": "clang", "error": "x.c:1: error: boom"}, gcc)
    assert failed.startswith("the native build failed: clang: x.c:1: error: boom")
    assert "missing" in nb.explain({"ok": True, "compiler": "cc"}, gcc)


def test_cc_is_split_as_a_shell_would_and_a_cc_naming_nothing_is_said(tmp_path):
    tools = tmp_path / "my tools"
    tools.mkdir()
    wrapper = tools / "cc wrapper"
    wrapper.write_text("#!/bin/sh\nexec cc \"$@\"\n")
    wrapper.chmod(0o755)
    path = os.environ["PATH"]
    assert nb.find_compiler({"CC": f"'{wrapper}' -O1", "PATH": path}) == ([str(wrapper), "-O1"], "")
    assert nb.find_compiler({"CC": "env FOO=1 cc", "PATH": path})[0] == [shutil.which("env"), "FOO=1", "cc"]
    assert nb.find_compiler({"CC": "ccache-nowhere gcc", "PATH": path}) == \
        (None, "CC='ccache-nowhere gcc': 'ccache-nowhere' is no program on PATH")
    assert "not a command a shell could split" in nb.find_compiler({"CC": "'unclosed", "PATH": path})[1]
    assert nb.find_compiler({"PATH": str(tmp_path)}) == \
        (None, "CC is unset and none of cc, gcc, clang is on PATH")


def _sources(tmp_path: Path) -> Path:
    """A copy of the sources (a build beside them, as an editable install's)."""
    where = tmp_path / "native"
    where.mkdir()
    for name in nb.SOURCES:
        shutil.copy(Path(nb.HERE) / name, where / name)
    return where


def test_a_failing_compiler_is_recorded_with_its_first_error_and_becomes_the_reason(tmp_path):
    where = _sources(tmp_path)
    (where / nb.LIB_NAME).write_bytes(b"an older build")
    with pytest.raises(nb.BuildError):
        nb.build(where=str(where), environ={"CC": "/bin/false", "PATH": os.environ["PATH"]})
    assert not (where / nb.LIB_NAME).exists()  # not this build's: gone
    record = nb.read_record(str(where / nb.LIB_NAME))
    assert record["ok"] is False and record["reason"] == nb.FAILED and record["compiler"] == "/bin/false"
    lib, why = native._load(str(where))
    assert lib is None
    assert why.startswith("the native build failed: /bin/false: it exited with status 1 and printed nothing"), why
    loud = tmp_path / "loud-cc"
    loud.write_text("#!/bin/sh\necho 'In file included from engine.c:1:' >&2\n"
                    "echo 'kernels.h:3:1: error: unknown type name' >&2\nexit 1\n")
    loud.chmod(0o755)
    with pytest.raises(nb.BuildError, match="unknown type name"):
        nb.build(where=str(where), environ={"CC": f"{loud} -Wall", "PATH": os.environ["PATH"]})
    assert native._load(str(where))[1].startswith(
        f"the native build failed: {loud} -Wall: kernels.h:3:1: error: unknown type name")


def test_a_compiler_with_arguments_builds_a_library_that_a_second_build_reuses(tmp_path):
    if nb.compiler() is None:
        pytest.skip("no C compiler")
    where = _sources(tmp_path)
    wrapper = tmp_path / "with space" / "cc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\ntouch '{tmp_path}/ran'\nexec {nb.compiler()[0]} \"$@\"\n")
    wrapper.chmod(0o755)
    env = {"CC": f"'{wrapper}' -DCPUDDP_TEST_FLAG=1", "PATH": os.environ["PATH"]}
    path, reused = nb.build(where=str(where), environ=env)
    assert not reused and (tmp_path / "ran").exists()
    record = nb.read_record(path)
    assert record["ok"] and "-DCPUDDP_TEST_FLAG=1" in record["command"] and record["sources"] == nb.digest(str(where))
    lib, why = native._load(str(where))
    assert lib is not None and why == "", why
    (tmp_path / "ran").unlink()
    assert nb.build(where=str(where), environ=env) == (path, True)  # nothing changed: not compiled again
    assert not (tmp_path / "ran").exists()
    with open(where / "kernels.h", "a") as f:
        f.write("\n/* changed */\n")
    assert nb.build(where=str(where), environ=env) == (path, False)  # the sources changed: compiled


def _wheel(tmp_path: Path, cc: str) -> Path:
    """``pip wheel`` of this checkout with ``CC=cc``, in place (no index, no isolation)."""
    try:
        import setuptools.command.bdist_wheel  # noqa: F401 - setuptools 70.1 or newer
    except ImportError:
        pytest.importorskip("wheel.bdist_wheel", reason="an in-place wheel build needs setuptools>=70.1 or wheel")
    src = tmp_path / "src"  # a copy: in-place builds of two tests at once would share build/
    (src / "tools").mkdir(parents=True)
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "tools/cpuddp_build.py"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "cpuddp", src / "cpuddp", ignore=shutil.ignore_patterns(
        "__pycache__", nb.LIB_NAME, os.path.basename(nb.record_path(nb.LIB_NAME)), ".libcpuddp_shm-*"))
    env = {**os.environ, "CC": cc, "PIP_NO_INDEX": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = tmp_path.glob("cpuddp-*.whl")
    return wheel


def test_a_wheel_built_without_a_compiler_is_pure_and_carries_no_library(tmp_path):
    """``CC=/bin/false``: the wheel is py3-none-any with the build record and no binary inside."""
    wheel = _wheel(tmp_path, "/bin/false")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("cpuddp/backends/shm/native/libcpuddp_shm.build.json").decode()
    assert not any(n.endswith(".so") for n in names)
    assert '"reason": "failed"' in record


@pytest.mark.slow
def test_a_wheel_with_its_library_is_tagged_for_what_the_library_needs(tmp_path):
    """The system compiler's wheel: py3-none-<the tag its library's ELF gives>, never any."""
    if nb.compiler() is None:
        pytest.skip("no C compiler")
    wheel = _wheel(tmp_path, nb.compiler()[0])
    with zipfile.ZipFile(wheel) as z:
        needs = elf.read(z.read("cpuddp/backends/shm/native/libcpuddp_shm.so"))
        meta = z.read("cpuddp-" + wheel.name.split("-")[1] + ".dist-info/WHEEL").decode()
    tag = elf.platform_tag(needs)
    assert wheel.name.endswith(f"-py3-none-{tag}.whl") and tag.startswith("manylinux_"), (wheel.name, needs)
    assert "Root-Is-Purelib: false" in meta and f"Tag: py3-none-{tag.split('.')[0]}" in meta, meta


# --------------------------------------------------------------------------- the vector code compiled


def _cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def test_the_library_runs_the_widest_width_the_cpu_and_os_have():
    try:
        lib = native.load()
    except native.Unavailable as exc:
        pytest.skip(f"no native library here: {exc}")
    flags = _cpu_flags()
    if not flags or os.uname().machine != "x86_64":
        pytest.skip("not an x86-64 Linux CPU")
    want = 2 if {"avx512f", "avx512bw", "avx512vl"} <= flags else 1 if "avx2" in flags else 0
    assert lib.best_isa() == want, (native.ISAS[lib.best_isa()], sorted(f for f in flags if f.startswith("avx")))
    assert [lib.isa_compiled(i) for i in range(3)] == [1, 1, 1]


def _kernel_lines(path: str, name: str) -> list:
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                          check=True).stdout
    block = dump.split(f"<{name}>:\n", 1)[1].split("\n\n", 1)[0]
    return block.splitlines()


def test_clang_compiles_the_vector_widths_for_their_isa(tmp_path):
    """clang ignores ``#pragma GCC target``: without its own attribute region its avx2 kernels
    were SSE code that the log called avx2."""
    if shutil.which("clang") is None or shutil.which("objdump") is None or os.uname().machine != "x86_64":
        pytest.skip("needs clang and objdump on x86-64")
    path, _ = nb.build(str(tmp_path / nb.LIB_NAME), environ={"CC": "clang", "PATH": os.environ["PATH"]})
    assert any("ymm" in line for line in _kernel_lines(path, "sum_f32_avx2"))
    assert any("zmm" in line for line in _kernel_lines(path, "sum_f32_avx512"))
    assert not any("ymm" in line or "zmm" in line for line in _kernel_lines(path, "sum_f32_scalar"))
