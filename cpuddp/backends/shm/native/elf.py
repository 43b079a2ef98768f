"""What a built library needs of the system that loads it, read from its ELF file (stdlib only:
setup.py loads this file by path), and the wheel platform tag that follows from it.

:func:`read` takes the library's bytes and gives its machine (``e_machine``), the shared
libraries it names (``DT_NEEDED``) and the symbol versions it needs from each (the
``.gnu.version_r`` section: ``GLIBC_2.17``, ...).  :func:`platform_tag` makes the tag a wheel
carrying it may claim: ``manylinux_2_Y_<arch>`` where Y is the newest glibc version it needs (at
least :data:`FLOOR`, the oldest glibc that manylinux tags for aarch64 name), and where it needs
nothing outside the libraries every glibc system has; ``linux_<arch>`` otherwise.  So a wheel
can never claim an older glibc than its library needs: the tag is read from the library built,
not from the compiler that was asked for.
"""

from __future__ import annotations

import struct
from typing import Dict, List, NamedTuple, Tuple

__all__ = ["Needs", "FLOOR", "MACHINES", "SYSTEM_LIBS", "read", "read_file", "glibc_needed", "platform_tag"]

#: the oldest glibc a tag names (manylinux2014: x86-64 and aarch64)
FLOOR = (2, 17)
#: ELF e_machine codes, by the name wheel tags use
MACHINES = {62: "x86_64", 183: "aarch64", 3: "i686", 21: "ppc64le", 22: "s390x", 243: "riscv64"}
#: libraries every glibc system has (the manylinux policy's, less those a C library of ours never needs)
SYSTEM_LIBS = frozenset({"libc.so.6", "libpthread.so.0", "libm.so.6", "libdl.so.2", "librt.so.1",
                         "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"})
_SHT_DYNAMIC, _SHT_VERNEED, _DT_NEEDED = 6, 0x6FFFFFFE, 1


class Needs(NamedTuple):
    """What a library needs: its machine's tag name, the libraries it names, the versions it needs of each."""

    machine: str
    libraries: Tuple[str, ...]
    versions: Dict[str, Tuple[str, ...]]


def _sections(data: bytes, end: str, wide: bool) -> List[Tuple[int, int, int, int]]:
    """Each section's (type, offset, size, link)."""
    if wide:
        shoff, = struct.unpack_from(end + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
        fmt, fields = end + "IIQQQQII", (1, 4, 5, 6)
    else:
        shoff, = struct.unpack_from(end + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x2E)
        fmt, fields = end + "IIIIIIII", (1, 4, 5, 6)
    out = []
    for i in range(shnum):
        row = struct.unpack_from(fmt, data, shoff + i * shentsize)
        out.append(tuple(row[f] for f in fields))
    return out


def _string(data: bytes, table: Tuple[int, int, int, int], at: int) -> str:
    start = table[1] + at
    return data[start:data.index(b"\0", start)].decode("ascii", "replace")


def read(data: bytes) -> Needs:
    """The needs of the ELF shared library ``data`` (its bytes); ``ValueError`` if it is none."""
    if data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        raise ValueError("not an ELF file")
    wide, end = data[4] == 2, "<" if data[5] == 1 else ">"
    machine_code, = struct.unpack_from(end + "H", data, 0x12)
    machine = MACHINES.get(machine_code)
    if machine is None:
        raise ValueError(f"an ELF file for machine {machine_code}, which no wheel tag here names")
    sections = _sections(data, end, wide)
    libraries: List[str] = []
    versions: Dict[str, Tuple[str, ...]] = {}
    for kind, offset, size, link in sections:
        if kind == _SHT_DYNAMIC:
            width = 16 if wide else 8
            for at in range(offset, offset + size, width):
                tag, value = struct.unpack_from(end + ("qQ" if wide else "iI"), data, at)
                if tag == _DT_NEEDED:
                    libraries.append(_string(data, sections[link], value))
        elif kind == _SHT_VERNEED:
            versions.update(_verneed(data, end, offset, sections[link]))
    return Needs(machine, tuple(libraries), versions)


def _verneed(data: bytes, end: str, at: int, strings: Tuple[int, int, int, int]) -> Dict[str, Tuple[str, ...]]:
    """``.gnu.version_r``: for each library, the version names needed of it (Elf_Verneed, Elf_Vernaux)."""
    out: Dict[str, Tuple[str, ...]] = {}
    while True:
        _, count, file_at, aux, nxt = struct.unpack_from(end + "HHIII", data, at)
        names, a = [], at + aux
        for _ in range(count):
            _, _, _, name_at, aux_next = struct.unpack_from(end + "IHHII", data, a)
            names.append(_string(data, strings, name_at))
            a += aux_next
        out[_string(data, strings, file_at)] = tuple(names)
        if not nxt:
            return out
        at += nxt


def read_file(path: str) -> Needs:
    """:func:`read` of the file at ``path``."""
    with open(path, "rb") as f:
        return read(f.read())


def glibc_needed(needs: Needs) -> Tuple[int, int]:
    """The newest ``GLIBC_x.y`` version the library needs, or (0, 0) when it needs none."""
    found = [(0, 0)]
    for names in needs.versions.values():
        for name in names:
            if name.startswith("GLIBC_") and name[6:].replace(".", "").isdigit():
                found.append(tuple(int(p) for p in name[6:].split(".")[:2]))  # type: ignore[misc]
    return max(found)  # type: ignore[return-value]


def platform_tag(needs: Needs) -> str:
    """The platform tag a wheel carrying this library may claim (see the module docstring);
    manylinux 2.17's legacy name is added for pips older than 20.3."""
    others = [lib for lib in needs.libraries if lib not in SYSTEM_LIBS]
    private = [n for names in needs.versions.values() for n in names
               if not (n.startswith("GLIBC_") and n[6:].replace(".", "").isdigit())]
    if others or private:
        return f"linux_{needs.machine}"
    major, minor = max(FLOOR, glibc_needed(needs))
    tag = f"manylinux_{major}_{minor}_{needs.machine}"
    if (major, minor) == FLOOR:
        tag += f".manylinux2014_{needs.machine}"
    return tag
