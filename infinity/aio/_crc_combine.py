"""The CRC32C of a whole file from its table of 4 KiB block sums, without reading it.

Note [combined sums]: a CRC is linear, so crc(A || B) = shift(crc(A), len(B)) ^ crc(B), where
``shift`` multiplies by x^(8 len(B)) modulo the polynomial (zlib's crc32_combine, here for
CRC32C's polynomial). Multiplying by a fixed power is a linear map on 32 bits, applied with
four 256-entry tables; the block sums are combined pairwise in a tree, one level per doubling
of the length, each level one vectorized step over all pairs, so a file of N blocks costs
O(N) array operations and log2(N) small tables (18 GB of swap: ~4.4 M sums, tens of ms). A
block whose sum is not known (entry 0, or a prefix shorter than the block) is summed from the
file itself by the caller. ``tests/integration/test_checkpoint_clone.py`` checks this against the CRC32C
of the bytes.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Tuple

import numpy as np

POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected
_X0 = 1 << 31  # x^0 in the reflected representation


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the polynomial (reflected bit order)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> List[int]:
    out, p = [], 1 << 30  # x^1
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return out


_X2N = _x2n_table()  # x^(2^k)


def _power(nbytes: int) -> int:
    """x^(8 nbytes) modulo the polynomial."""
    p, k, n = _X0, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of A || B from crc(A), crc(B) and len(B)."""
    return _multmodp(_power(len2), crc1) ^ crc2


@lru_cache(maxsize=64)  # one per level: 4 KiB x 2^k, the same for every file and every save
def _tables(nbytes: int) -> np.ndarray:
    """Four 256-entry tables that apply shift-by-``nbytes`` to each byte of a 32-bit value."""
    c = _power(nbytes)
    out = np.zeros((4, 256), dtype=np.uint32)
    for j in range(4):
        t = np.zeros(1, dtype=np.uint32)
        for bit in range(8):
            t = np.concatenate([t, t ^ np.uint32(_multmodp(c, 1 << (8 * j + bit)))])
        out[j] = t
    out.flags.writeable = False  # shared by every caller through the cache
    return out


def _shift(values: np.ndarray, tables: np.ndarray) -> np.ndarray:
    return (tables[0][values & 0xFF] ^ tables[1][(values >> 8) & 0xFF]
            ^ tables[2][(values >> 16) & 0xFF] ^ tables[3][values >> 24])


def combine_blocks(sums: np.ndarray, block: int, last_len: int) -> int:
    """CRC32C of consecutive blocks whose own CRC32Cs are ``sums`` (uint32): every block
    ``block`` bytes long except the last, ``last_len`` bytes (Note [combined sums])."""
    if len(sums) == 0:
        return 0
    crcs = np.asarray(sums, dtype=np.uint32)
    carries: List[Tuple[int, int]] = []  # right-hand pieces set aside, rightmost first
    if last_len != block:
        carries.append((int(crcs[-1]), last_len))
        crcs = crcs[:-1]
    length = block
    while len(crcs) > 1:
        if len(crcs) % 2:
            carries.append((int(crcs[-1]), length))
            crcs = crcs[:-1]
        crcs = _shift(crcs[0::2], _tables(length)) ^ crcs[1::2]
        length *= 2
    crc = int(crcs[0]) if len(crcs) else None
    for c, n in reversed(carries):
        crc = c if crc is None else combine(crc, c, n)
    return int(crc) if crc is not None else 0
