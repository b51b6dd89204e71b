"""A float32 sum over processes that sends 16-bit values: bf16 or fp16 on the wire, float32 in
every addition.

The sum is a reduce-scatter done by hand, then an all-gather: each process rounds its tensor to
16 bits once, and an all-to-all (started asynchronously, so it overlaps backward as a bucket's
all-reduce does) hands every process all copies of its own chunk; ``wait()`` adds them in
float32, in rank order, and rounds the sum once; an all-gather gives every process the whole
sum, cast back to float32 into the tensor. Every process ends with the same bits, having sent
half the bytes of a float32 all-reduce (``Traffic``). Under fp16 each chunk travels scaled by a
power of two chosen from its largest magnitude (the exponent sent alongside), so nothing
overflows and small values keep 11 bits; a chunk holding inf or NaN travels unscaled, so a loss
scaler sees the overflow. bf16 has float32's range and needs no scaling.
"""

from __future__ import annotations

import math

import torch

from stratagem.comm.communicator import Communicator, PendingOp

COMPRESSIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
# A chunk is scaled so that its largest magnitude is at most 2**_FP16_TOP (< 65504).
_FP16_TOP = 15


def check_compression(compression: object, *, what: str) -> str | None:
    """``compression`` if it is None or a known name; else a ValueError naming ``what``."""
    if compression is None or compression in COMPRESSIONS:
        return compression  # type: ignore[return-value]
    raise ValueError(f"{what}: compression must be None, 'bf16' or 'fp16', got {compression!r}")


class CompressedSum:
    """Sums float32 tensors of ``numel`` values over the processes of ``comm``, 16-bit on the
    wire (see the module). Holds its buffers from one sum to the next: a bucket reduced every
    step reuses them rather than fault in fresh pages each time."""

    def __init__(
        self, comm: Communicator, numel: int, compression: str, device: torch.device
    ) -> None:
        self._comm, self._numel = comm, numel
        self._dtype = COMPRESSIONS[compression]
        self._scaled = compression == "fp16"
        n = comm.world_size
        self._chunk = math.ceil(numel / n)
        # Each row: one chunk, and its exponent when scaled (the last chunk padded with zeros).
        self._width = self._chunk + (1 if self._scaled else 0)
        empty = lambda size, dtype=self._dtype: torch.empty(size, dtype=dtype, device=device)  # noqa: E731
        self._send = torch.zeros(n * self._width, dtype=self._dtype, device=device)
        self._received = empty(n * self._width)
        self._total = empty(self._chunk, torch.float32)
        self._scratch = empty(self._chunk, torch.float32) if self._scaled else self._total
        self._mine = empty(self._width)
        self._everyone = empty(n * self._width)

    def _pieces(self) -> list[slice]:
        """Where each chunk lies in the tensor (the last one may be short, or empty)."""
        c, numel = self._chunk, self._numel
        return [
            slice(min(i * c, numel), min((i + 1) * c, numel)) for i in range(self._comm.world_size)
        ]

    def _exponent(self, values: torch.Tensor) -> int:
        """e such that values * 2**-e lies within fp16's range, its largest near 2**15; 0 for a
        chunk of zeros or one holding inf or NaN (they travel as they are)."""
        if not self._scaled or values.numel() == 0:
            return 0
        largest = float(values.abs().max())
        if largest == 0 or not math.isfinite(largest):
            return 0
        return math.frexp(largest)[1] - _FP16_TOP

    def start(self, tensor: torch.Tensor, *, what: str) -> PendingOp:
        """Start the sum of ``tensor`` (1-D float32, ``numel`` values) in place; the result
        is there after ``wait()``, which runs the second collective: call it in the same order
        on every process."""
        if tensor.dtype != torch.float32 or tensor.shape != (self._numel,):
            raise ValueError(
                f"a {self._dtype}-compressed all-reduce of {what} takes a 1-D float32 tensor "
                f"of {self._numel} values, got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )
        rows = self._send.view(-1, self._width)
        for i, piece in enumerate(self._pieces()):
            values = tensor[piece]
            e = self._exponent(values)
            rows[i, : values.numel()].copy_(
                values if e == 0 else torch.ldexp(values, torch.tensor(-e))
            )
            if self._scaled:
                rows[i, -1] = e
        name = f"{what} ({self._dtype}-compressed"
        first = self._comm.all_to_all_async(self._received, self._send, what=f"{name}, part 1/2)")
        self._comm.traffic.all_reduces += 1  # its two collectives are one all-reduce
        return _PendingSum(self, first, tensor, f"{name}, part 2/2)")

    def finish(self, tensor: torch.Tensor, what: str) -> None:
        """The second half of a sum whose all-to-all is done."""
        c = self._chunk
        total = self._total
        for i, row in enumerate(self._received.view(-1, self._width)):
            scale = 2.0 ** float(row[-1]) if self._scaled else 1.0
            if i == 0:
                total.copy_(row[:c])
                if scale != 1.0:
                    total.mul_(scale)
            elif scale == 1.0:
                total.add_(row[:c])  # every addition in float32
            else:
                # Not add_(alpha=): with a 16-bit operand that path is 5x slower on CPU.
                total.add_(self._scratch.copy_(row[:c]).mul_(scale))
        e = self._exponent(total)
        self._mine[:c].copy_(
            total if e == 0 else torch.ldexp(total, torch.tensor(-e))
        )  # rounded once
        if self._scaled:
            self._mine[-1] = e
        self._comm.all_gather_into(self._everyone, self._mine, what=what)
        rows = self._everyone.view(-1, self._width)
        for i, piece in enumerate(self._pieces()):
            part = tensor[piece]
            part.copy_(rows[i, : part.numel()])
            if self._scaled and float(rows[i, -1]) != 0:
                part.mul_(2.0 ** float(rows[i, -1]))


class _PendingSum(PendingOp):
    def __init__(self, sum_: CompressedSum, first: PendingOp, tensor: torch.Tensor, what: str):
        self._sum, self._first, self._tensor, self._what = sum_, first, tensor, what

    def wait(self) -> None:
        self._first.wait()
        self._sum.finish(self._tensor, self._what)


def compressed_all_reduce(
    comm: Communicator, tensor: torch.Tensor, compression: str, *, what: str
) -> PendingOp:
    """Start a SUM all-reduce of the 1-D float32 ``tensor`` in place, sent in 16 bits
    (``compression``: "bf16" or "fp16") and added in float32; done after ``wait()``. For one
    sum; a tensor reduced repeatedly keeps a ``CompressedSum``."""
    return CompressedSum(comm, tensor.numel(), compression, tensor.device).start(tensor, what=what)
