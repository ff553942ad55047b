"""Lists the GPU targets compiled into a shared object, without cuobjdump.

The build machines have nvcc but no cuobjdump, and `python -m mla_ext info`
must still say which cubins the library really carries. CUDA objects keep
their device code in the ELF section `.nv_fatbin`: a sequence of fatbin
containers (magic 0xBA55ED50), each a list of entries with a small header:

    u16 kind (1 = PTX, 2 = ELF cubin), u16 version, u32 header size,
    u32 padded payload size, ..., u32 sm version at byte 28,
    u64 flags at byte 40 (bit 0x100000 marks an arch-specific 'a' target).

Only headers are read; payloads (possibly compressed) are skipped.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_CUBIN = 1, 2
FLAG_ARCH_SPECIFIC = 0x100000


class Target(NamedTuple):
    """One entry of a fatbin: a SASS binary (`ptx` False) or PTX, for sm version `sm`
    (86 for 8.6, 100 for 10.0) as the header stores it, as integers."""

    sm: int
    ptx: bool
    arch_specific: bool  # an 'a' target (sm_90a): runs on exactly that arch

    @property
    def capability(self) -> tuple[int, int]:
        return divmod(self.sm, 10)

    def __str__(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.sm}{'a' if self.arch_specific else ''}"


def _section(data: bytes, wanted: str) -> tuple[int, int] | None:
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit ELF only
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for name, _typ, _flags, _addr, offset, size in headers:
        end = data.index(b"\0", names_at + name)
        if data[names_at + name:end].decode(errors="replace") == wanted:
            return offset, size
    return None


def targets(path: str) -> list[str]:
    """Sorted unique targets: 'sm_86', 'sm_90a' for cubins, 'compute_XX' for PTX."""
    return sorted(str(t) for t in entries(path))


def entries(path: str) -> list[Target]:
    """The unique targets of the file's fatbin, as read from the entry headers."""
    with open(path, "rb") as f:
        data = f.read()
    sec = _section(data, ".nv_fatbin")
    if sec is None:
        return []
    start, size = sec
    found: set[Target] = set()
    p, end = start, start + size
    while p + 16 <= end:
        magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8  # containers are 8-byte aligned
            continue
        q, cend = p + hsize, min(p + hsize + fsize, end)
        while q + 48 <= cend:
            kind, _v, ehsize, padded = struct.unpack_from("<HHII", data, q)
            sm = struct.unpack_from("<I", data, q + 28)[0]
            flags = struct.unpack_from("<Q", data, q + 40)[0]
            if kind in (KIND_CUBIN, KIND_PTX):
                found.add(Target(sm, kind == KIND_PTX, bool(flags & FLAG_ARCH_SPECIFIC)))
            if ehsize == 0:
                break
            q += ehsize + padded
        p += hsize + fsize
    return sorted(found)


def runs_on(available: list[Target], capability: tuple[int, int]) -> Target | None:
    """The entry the CUDA driver would run on a device of `capability` (major, minor),
    or None. A SASS binary serves its own major version at a minor >= its own (sm_86
    code runs on sm_89, not on sm_90 nor sm_80); an arch-specific one (sm_90a) only
    its exact arch; PTX is JIT-compiled on its arch and anything newer (compute_90a
    PTX only on sm_90). SASS wins over PTX (no JIT), the exact 'a' binary over a
    generic one, and the newest that fits over older ones."""
    major, minor = capability

    def fits(t: Target) -> bool:
        if t.arch_specific:
            return t.capability == (major, minor)
        if t.ptx:
            return t.capability <= (major, minor)
        return t.capability[0] == major and t.capability[1] <= minor

    usable = [t for t in available if fits(t)]
    if not usable:
        return None
    return max(usable, key=lambda t: (not t.ptx, t.arch_specific, t.sm))
