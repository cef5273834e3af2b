"""Facts read from a cubin (an ELF file): its SASS arch and whether it holds PTX.

Used by the build (to check what nvcc produced) and by the tests.  No CUDA
tools are needed: the ELF header and section names say it all.
"""

from __future__ import annotations

import re
import struct

EM_CUDA = 190


def elf_sections(data: bytes) -> list:
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    strtab_off = headers[e_shstrndx][4]
    names = []
    for h in headers:
        start = strtab_off + h[0]
        names.append(data[start:data.index(b"\0", start)].decode())
    return names


def cubin_arch(data: bytes) -> str:
    """``'sm_90a'`` etc.: the SM number from the ELF header, confirmed by the
    ptxas command line nvcc records in the ``.note.nv.tkinfo`` section (which is
    also where the arch-specific ``a`` suffix shows)."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF cubin")
    (e_machine,) = struct.unpack_from("<H", data, 0x12)
    if e_machine != EM_CUDA:
        raise ValueError(f"ELF machine {e_machine} is not CUDA")
    (e_flags,) = struct.unpack_from("<I", data, 0x30)
    sm = (e_flags >> 8) & 0xFF
    match = re.search(rb"-arch (sm_[0-9]+a?)\b", data)
    if match is None or not match.group(1).decode().startswith(f"sm_{sm}"):
        raise ValueError(f"cubin arch note {match and match.group(1)} disagrees with ELF flags (sm_{sm})")
    return match.group(1).decode()


def has_ptx(data: bytes) -> bool:
    return any("ptx" in name.lower() for name in elf_sections(data))
