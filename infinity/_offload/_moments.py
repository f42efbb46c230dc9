"""Adam's moments stored compressed on NVMe (``zero.offload_optimizer.moments``).

Note [compressed moments]: with ``moments: bf16`` or ``int8`` the optimizer swapper keeps
``exp_avg`` and ``exp_avg_sq`` in their files as one fixed-size *record* per swap chunk
(the master weights and gradients stay fp32). A record is read whole, expanded into the
chunk's fp32 work buffers, Adam runs in fp32 exactly as always, and the result is compressed
back into the record and written. The bytes moved per step for the moments drop 2x (bf16) or
~4x (int8: one byte per element plus an fp32 scale per block of ``BLOCK`` elements, the
record rounded up to 4 KiB for O_DIRECT).

Codes (per block of ``BLOCK`` = 2048 elements, as bitsandbytes and torchao block-quantize):
  bf16           the fp32 value rounded to bfloat16.
  int8 exp_avg   signed, a square-root companding of the block's absmax-normalised value:
                 q = round(127 * sign(x) * sqrt(|x| / absmax)), x = sign(q) (q/127)^2 absmax.
                 The relative step is 2/|q|: values a thousandth of the block's largest still
                 keep ~6% resolution, where a linear code rounds them to zero.
  int8 exp_avg_sq non-negative, a fourth-root companding (the code of sqrt(v) squared):
                 q = round(255 (v / max)^(1/4)), v = (q/255)^4 max. Adam divides by sqrt(v),
                 so what matters is sqrt(v)'s relative error (2 * 0.5/q); a nonzero v never
                 rounds to code 0 (the smallest code is used instead), so the denominator never
                 collapses to eps and the update never explodes.
Rounding is stochastic (unbiased in code space): with round-to-nearest, ``v = 0.999 v +
0.001 g^2`` changes v by 0.1% a step, less than half a bf16 ulp (0.4%) or an int8 step, and v
would freeze; stochastic rounding keeps the expected update. The noise comes from the store's
own generator (seeded by the rank), so runs are reproducible. ``benchmarks/compressed_states.py``
measures the codes on a real fine-tune; ``tests/unit/test_compressed_moments.py`` bounds their
round-trip errors.
"""
from __future__ import annotations

import torch

from ..errors import UsageError
from ._layout import round_up

BLOCK = 2048  # elements per int8 scale (ALIGN_ELEMS: every chunk is whole blocks)
RECORD_ALIGN = 4096  # O_DIRECT: records start and end on 4 KiB
MODES = ("fp32", "bf16", "int8")
_NOISE = 1 << 16  # fp32 bits below bf16's mantissa


class Codec:
    """The records of one moments mode for chunks of up to ``chunk`` elements: bf16 values, or
    the int8 codes of the chunk's n elements followed (at byte n rounded up to 16) by one fp32
    scale per block. Record k of a file starts at byte k * ``record`` (a whole chunk's record);
    the last, shorter chunk's record is shorter too (``length``)."""

    def __init__(self, mode: str, chunk: int, native: bool = True, threads: int = 1):
        if mode not in MODES[1:]:
            raise UsageError(f"no compressed records for moments {mode!r}; use one of {', '.join(MODES[1:])}")
        self.mode, self.chunk = mode, chunk
        self.record = record_bytes(mode, chunk)
        self.threads = threads
        self.lib = _native() if native else None  # None: the torch code below

    def encode(self, x: torch.Tensor, record: torch.Tensor, signed: bool, gen: torch.Generator) -> None:
        """Compress the fp32 ``x`` (at most ``chunk`` elements) into the uint8 ``record``."""
        n = x.numel()
        if self.lib is not None:
            seed = int(torch.randint(0, 1 << 31, (), generator=gen))
            if self.mode == "bf16":
                self.lib.encode_bf16(x.data_ptr(), record.data_ptr(), n, seed, self.threads)
            else:
                self.lib.encode_int8(x.data_ptr(), record.data_ptr(), self._scales(record, n).data_ptr(), n, signed,
                                     seed, self.threads)
            return
        if self.mode == "bf16":
            _encode_bf16(x, record, gen)
        else:
            _encode_int8(x, record[: x.numel()], self._scales(record, x.numel()), signed, gen)

    def decode(self, record: torch.Tensor, out: torch.Tensor, signed: bool) -> None:
        """Expand the uint8 ``record`` into the fp32 ``out``."""
        n = out.numel()
        if self.lib is not None:
            if self.mode == "bf16":
                self.lib.decode_bf16(record.data_ptr(), out.data_ptr(), n, self.threads)
            else:
                self.lib.decode_int8(record.data_ptr(), self._scales(record, n).data_ptr(), out.data_ptr(), n, signed,
                                     self.threads)
            return
        if self.mode == "bf16":
            out.copy_(record[: 2 * n].view(torch.bfloat16))
            return
        codes = record[:n]
        out.copy_(codes.view(torch.int8) if signed else codes)
        scale = self._scales(record, n)
        _blockwise(out, lambda b, s: _expand(b, s, signed), scale)

    def length(self, n: int) -> int:
        """Bytes of the record of an ``n``-element chunk."""
        return record_bytes(self.mode, n)

    def _scales(self, record: torch.Tensor, n: int) -> torch.Tensor:
        at = round_up(n, 16)
        return record[at : at + 4 * _blocks(n)].view(torch.float32)


def _native():
    """The native codes (native/cpu_adam/moments.cpp), or None when the library is not built."""
    try:
        from .. import _cpu_adam  # late: optional, absent where the library was not built
    except ImportError:
        return None
    return _cpu_adam if hasattr(_cpu_adam, "encode_int8") else None


def record_bytes(mode: str, chunk: int) -> int:
    """Bytes of one compressed record of a ``chunk``-element swap chunk."""
    if mode == "bf16":
        return round_up(2 * chunk, RECORD_ALIGN)
    return round_up(round_up(chunk, 16) + 4 * _blocks(chunk), RECORD_ALIGN)


def file_bytes(mode: str, total: int, chunk: int) -> int:
    """Bytes of one moment's swap file: fp32, or one record per chunk."""
    if mode == "fp32":
        return 4 * total
    full, rest = divmod(total, chunk)
    return full * record_bytes(mode, chunk) + (record_bytes(mode, rest) if rest else 0)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _blockwise(t: torch.Tensor, fn, scale: torch.Tensor, other=None) -> None:
    """fn(block view (blocks, BLOCK), the blocks' scales[, ``other`` viewed alike]) over whole
    blocks, then the short tail block."""
    n = t.numel()
    full = n // BLOCK
    cut = [(slice(0, full * BLOCK), slice(0, full), full)] if full else []
    if full * BLOCK < n:
        cut.append((slice(full * BLOCK, n), slice(full, full + 1), 1))
    for el, bl, rows in cut:
        extra = () if other is None else (other[el].view(rows, -1),)
        fn(t[el].view(rows, -1), scale[bl], *extra)


def _expand(q: torch.Tensor, scale: torch.Tensor, signed: bool) -> None:
    """Codes (as floats) of whole blocks, in place into values."""
    if signed:
        q.mul_(q.abs()).mul_(scale[:, None] / (127.0 * 127.0))  # sign(q) (q/127)^2 absmax
    else:
        q.mul_(1.0 / 255.0).square_().square_().mul_(scale[:, None])  # (q/255)^4 max


def _encode_bf16(x: torch.Tensor, record: torch.Tensor, gen: torch.Generator) -> None:
    n = x.numel()
    bits = x.view(torch.int32) + torch.randint(0, _NOISE, (n,), dtype=torch.int32, generator=gen)
    bits.bitwise_and_(-_NOISE)  # uniform noise below the kept bits, then truncation: stochastic rounding
    record[: 2 * n].view(torch.bfloat16).copy_(bits.view(torch.float32))  # exact: the low bits are zero


def _encode_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, signed: bool,
                 gen: torch.Generator) -> None:
    top = 127.0 if signed else 255.0
    y = torch.empty_like(x)

    def normalise(b: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
        m = b.abs().amax(1)
        s.copy_(m)
        out.copy_(b).abs_().mul_(torch.where(m > 0, 1.0 / m, 0.0)[:, None])  # |x| / max in [0, 1]
        out.sqrt_()
        if not signed:
            out.sqrt_()  # v^(1/4): the code of sqrt(v), companded once more
        out.mul_(top)

    _blockwise(x, normalise, scale, y)
    q = y.add_(torch.rand(x.numel(), generator=gen)).floor_().clamp_(max=top)  # stochastic rounding
    if signed:
        codes.view(torch.int8).copy_(q.mul_(torch.sign(x)))
    else:
        codes.copy_(q.masked_fill_((q == 0) & (x > 0), 1.0))  # a nonzero v keeps a nonzero code
