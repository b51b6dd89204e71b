"""Gradient all-reduce across processes, bucketed and overlapped with the backward pass.

As DDP does, ``GradientReducer`` groups parameters into buckets in reverse creation order; a
bucket whose gradients are all accumulated starts an asynchronous all-reduce while backward goes
on, and at the end of backward (an autograd engine callback) the sums are waited for and copied
into the ``.grad`` tensors. Gradients are SUMMED across processes (``average=True``: PyTorch's
mean). Accumulating several backward passes before a step stays exact: only what was not yet
reduced is sent; with ``deferring = True`` (``accumulate_gradients``) passes only accumulate and
the next one sends everything at once; an optimizer step (``flush()``) reduces what a deferred
pass left. A parameter no process used keeps its ``grad`` (None stays None): each bucket carries
two flags per parameter, "used here" and "still held here". ``compression`` ("bf16", "fp16")
sends 16 bits and adds in float32 (``comm.compression``; under fp16 the flags travel apart, in
float32). Parameters are held weakly: a dropped model's slots leave the buckets once every
process has let it go. Bucket sizes are the caller's (``MultiWorkerMirroredStrategy``'s).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stratagem.comm.communicator import Communicator, PendingOp
from stratagem.comm.compression import CompressedSum
from stratagem.comm.reduce_op import ReduceOp

# A bucket size no model reaches: each (device, dtype) in one bucket, launched when its last
# gradient comes (at the end of backward).
ONE_PACK = 1 << 62

_FRESH = 1  # .grad was None; the accumulated .grad is exactly this pass's gradient
_ADDED = 2  # .grad already held a value; this pass's gradient was sent alone


@dataclass(eq=False)
class _Entry:
    """One parameter in charge: held weakly, with what its slot needs once it is gone."""

    ref: weakref.ref[torch.nn.Parameter]
    shape: torch.Size
    numel: int
    nbytes: int
    device: torch.device
    dtype: torch.dtype
    handles: list[Any]  # its hooks, removed with it
    bucket: _Bucket | None = None
    index: int = 0  # position within the bucket
    state: int = 0


@dataclass
class _Bucket:
    entries: list[_Entry]
    buffer: torch.Tensor  # the gradients of entries, flat, then two flags per entry
    views: list[torch.Tensor]  # each entry's part of buffer, shaped like its parameter
    flags: torch.Tensor  # the flag part of buffer: a gradient flag per entry, then a live flag
    what: str  # how errors name this bucket's all-reduce
    ready: int = 0
    collected: int = 0  # entries whose parameter this process has let go (they never fill)
    complete: bool = False  # launched with every gradient of this process present
    pending: PendingOp | None = None
    compressed: CompressedSum | None = None  # its buffers, when sent in 16 bits

    @property
    def numel(self) -> int:
        return self.buffer.numel() - 2 * len(self.entries)


class _Both(PendingOp):
    def __init__(self, first: PendingOp, second: PendingOp) -> None:
        self._ops = (first, second)

    def wait(self) -> None:
        for op in self._ops:  # in launch order on every process
            op.wait()


@dataclass
class GradientReducer:
    """Sums the gradients of ``params`` over all processes of ``comm`` after every backward."""

    comm: Communicator
    first_bucket_bytes: int = 1 << 20
    bucket_bytes: int = 4 << 20
    average: bool = False
    compression: str | None = None  # None, "bf16", "fp16": float32 buckets sent in 16 bits
    deferring: bool = False  # backward passes accumulate locally, reduced later (see module)
    _entries: list[_Entry] = field(default_factory=list)  # in the order adopted
    _buckets: list[_Bucket] = field(default_factory=list)
    _next_launch: int = 0
    _in_backward: bool = False
    # Deferred passes: parameters whose whole .grad is local (not yet reduced), and the local
    # parts kept aside for parameters whose .grad held a reduced value already.
    _unreduced: set[_Entry] = field(default_factory=set)
    _held: dict[_Entry, torch.Tensor] = field(default_factory=dict)
    _deferred_pass: bool = False
    # Called with each bucket's byte count as its all-reduce is launched (``OverlapProbe``).
    launch_listeners: list[Callable[[int], None]] = field(default_factory=list)

    def add_parameters(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Take charge of more parameters (a strategy calls this as models are built), and let
        go of those collected since on every process.

        Every process calls this together (at the adoption of a model, in the same order, each
        with the same model), so it is where they agree on the buckets. Garbage collection
        frees a dropped model at different times on different processes, so the layout cannot
        follow each process's own collection; rebuilding at a step would need a collective every
        step to agree. Here an adoption costs one small all-reduce of who still holds what, and
        steps cost nothing. A model dropped with none built after it keeps its (zero, flag 0)
        slots until the next adoption."""
        known = {id(p) for e in self._entries if (p := e.ref()) is not None}
        new = [p for p in params if p.requires_grad and id(p) not in known]
        if not new:
            return
        self.flush()
        self._forget_collected()
        for p in new:
            entry = _Entry(
                weakref.ref(p, self._on_collected), p.shape, p.numel(),
                p.numel() * p.element_size(), p.device, p.dtype, [],
            )  # fmt: skip
            # Hooks on the tensor itself (not on its AccumulateGrad node, which would have to
            # be kept alive, and holds the parameter): they close over the entry, not the
            # parameter, so the parameter dies with its model.
            entry.handles.append(p.register_hook(self._make_prehook(entry)))
            entry.handles.append(p.register_post_accumulate_grad_hook(self._make_posthook(entry)))
            self._entries.append(entry)
        self._build_buckets()

    def _forget_collected(self) -> None:
        """Drop the entries whose parameter every process has let go (a collective)."""
        if not self._entries:
            return
        alive = torch.tensor(
            [e.ref() is not None for e in self._entries],
            dtype=torch.int32,
            device=self._entries[0].device,  # where the buckets' own all-reduces run (NCCL)
        )
        if self.comm.world_size > 1:
            # Kept while any process still holds it: a slot dropped here alone would make the
            # buckets differ between processes, and their all-reduces would not pair up.
            self.comm.all_reduce(alive, ReduceOp.MAX, what="which adopted parameters still live")
        self._drop([e for e, live in zip(self._entries, alive.tolist()) if not live])

    def _drop(self, gone: list[_Entry]) -> None:
        """Let go of entries every process agreed are gone: their hooks and their slots (the
        caller rebuilds the buckets)."""
        for entry in gone:
            for handle in entry.handles:
                handle.remove()
            # Its bucket points back at it: break the cycle, so that the old buckets (their
            # buffers as big as the gradients) are freed when a rebuild drops them, not when
            # the cycle collector runs.
            entry.bucket = None
        dropped = set(gone)
        self._entries = [e for e in self._entries if e not in dropped]

    def _on_collected(self, ref: weakref.ref) -> None:
        # A parameter let go here (a tie built after the model: Hugging Face's lm_head) never
        # fills its slot: its bucket must not wait for it, or that bucket and every one after
        # it would start only at the end of backward, with no overlap left (the slot goes out
        # as zeros, flag 0, as at a flush).
        for entry in self._entries:
            if entry.ref is ref and entry.bucket is not None:
                entry.bucket.collected += 1

    def _build_buckets(self) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[_Entry]] = {}
        for e in reversed(self._entries):
            groups.setdefault((e.device, e.dtype), []).append(e)
        self._buckets = []
        for (device, dtype), entries in groups.items():
            cap, current, size = self.first_bucket_bytes, [], 0
            for e in entries:
                if current and size + e.nbytes > cap:
                    self._add_bucket(current, device, dtype)
                    cap, current, size = self.bucket_bytes, [], 0
                current.append(e)
                size += e.nbytes
            if current:
                self._add_bucket(current, device, dtype)
        self._next_launch = 0

    def _add_bucket(self, entries: list[_Entry], device: torch.device, dtype: torch.dtype) -> None:
        total = sum(e.numel for e in entries)
        buffer = torch.zeros(total + 2 * len(entries), device=device, dtype=dtype)
        views, offset = [], 0
        for e in entries:
            views.append(buffer[offset : offset + e.numel].view(e.shape))
            offset += e.numel
        what = f"gradients of {len(entries)} parameters ({total} values)"
        bucket = _Bucket(entries, buffer, views, buffer[total:], what)
        bucket.collected = sum(e.ref() is None for e in entries)
        self._buckets.append(bucket)
        for i, e in enumerate(entries):
            e.bucket, e.index = bucket, i

    # ------------------------------------------------------------------ autograd hooks

    def _make_prehook(self, key: _Entry) -> Any:
        def prehook(incoming: torch.Tensor) -> torch.Tensor | None:
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            param = key.ref()
            assert param is not None  # backward is computing its gradient
            if self.deferring:
                self._deferred_pass = True
                if param.grad is None or key in self._unreduced:
                    self._unreduced.add(key)
                    return None  # all of .grad is local: it accumulates there
                # .grad holds a reduced value: this pass's part waits aside, to be sent alone.
                held = self._held.get(key)
                self._held[key] = incoming.detach().clone() if held is None else held + incoming
                return torch.zeros_like(incoming)
            if param.grad is None or key in self._unreduced:
                return None  # the post-accumulate hook sends the whole accumulated gradient
            # Accumulating onto a reduced gradient: send this pass's part (with any deferred
            # part) alone, and keep it out of .grad for now; it comes back summed.
            held = self._held.pop(key, None)
            self._fill(key, incoming if held is None else held + incoming, _ADDED)
            return torch.zeros_like(incoming)

        return prehook

    def _make_posthook(self, entry: _Entry) -> Callable[[torch.Tensor], None]:
        def on_accumulated(param: torch.Tensor) -> None:
            if entry.state == 0 and not self.deferring:
                assert param.grad is not None
                self._fill(entry, param.grad, _FRESH)

        return on_accumulated

    def _fill(self, entry: _Entry, grad: torch.Tensor, state: int) -> None:
        bucket = entry.bucket
        assert bucket is not None
        if grad.requires_grad:  # create_graph=True: the copy must not join the graph
            with torch.no_grad():
                bucket.views[entry.index].copy_(grad)
        else:  # the usual backward, which records nothing (no_grad costs a Python call here)
            bucket.views[entry.index].copy_(grad)
        entry.state = state
        bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        # Buckets start in a fixed order on every process: collectives pair up by order.
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.ready + bucket.collected < len(bucket.entries):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.complete = bucket.ready == len(bucket.entries)
        with torch.no_grad():
            if bucket.complete:
                bucket.flags.fill_(1)
            else:
                # Parameters with no gradient in this pass send what deferred passes left;
                # those with none at all, or collected here, contribute zeros (flag 0).
                for entry, view in zip(bucket.entries, bucket.views):
                    if entry.state:
                        continue
                    p = entry.ref()
                    if entry in self._unreduced and p is not None and p.grad is not None:
                        view.copy_(p.grad)
                        entry.state = _FRESH
                    elif entry in self._held:
                        view.copy_(self._held.pop(entry))
                        entry.state = _ADDED
                    else:
                        view.zero_()
                states = [1 if e.state else 0 for e in bucket.entries]
                live = [0 if e.ref() is None else 1 for e in bucket.entries]
                bucket.flags.copy_(torch.tensor(states + live))
        compress = self.compression is not None and self.comm.world_size > 1
        if compress and bucket.buffer.dtype == torch.float32:
            # fp16: the flags apart (see the module); bf16: the whole buffer, flags included.
            sent = bucket.buffer if self.compression == "bf16" else bucket.buffer[: bucket.numel]
            if bucket.compressed is None:
                bucket.compressed = CompressedSum(
                    self.comm, sent.numel(), self.compression, sent.device
                )
            values = bucket.compressed.start(sent, what=bucket.what)
            if sent.numel() == bucket.buffer.numel():
                bucket.pending = values
            else:
                flags = self.comm.all_reduce_async(bucket.flags, what=f"flags of {bucket.what}")
                bucket.pending = _Both(values, flags)
        else:
            bucket.pending = self.comm.all_reduce_async(bucket.buffer, what=bucket.what)
        for listener in self.launch_listeners:
            listener(bucket.numel * bucket.buffer.element_size())

    def _end_of_backward(self) -> None:
        self._in_backward = False
        self.flush(deferred=False)

    # ------------------------------------------------------------------ completion

    def pending(self) -> bool:
        """Whether a backward pass left gradients that are not yet summed."""
        return any(b.ready for b in self._buckets) or self._deferred_pass

    def flush(self, *, deferred: bool = True) -> None:
        """Finish the reduction of everything accumulated so far, and write it back;
        ``deferred=False`` leaves what deferred passes accumulated for later."""
        if not any(b.ready for b in self._buckets) and not (deferred and self._deferred_pass):
            return
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket)
        self._next_launch = len(self._buckets)
        divisor = float(self.comm.world_size) if self.average else 1.0
        gone: list[_Entry] = []  # let go on every process: the sums say so, alike everywhere
        with torch.no_grad():
            for bucket in self._buckets:
                assert bucket.pending is not None
                bucket.pending.wait()
                bucket.pending = None
                gone += self._write_back(bucket, divisor)
        self._reset()
        if gone:
            self._drop(gone)
            self._build_buckets()

    def _write_back(self, bucket: _Bucket, divisor: float) -> list[_Entry]:
        """Write the sums back into the gradients; the entries every process has let go."""
        n = len(bucket.entries)
        if bucket.complete:
            # This process had every gradient: every count is at least 1, every slot lives.
            counts, gone = [1] * n, []
        else:
            flags = bucket.flags.tolist()
            counts = flags[:n]
            gone = [e for e, live in zip(bucket.entries, flags[n:]) if live == 0]
        if divisor != 1.0:
            bucket.buffer[: bucket.numel].div_(divisor)
        for entry, summed, count in zip(bucket.entries, bucket.views, counts):
            if count == 0:
                continue  # no process has a gradient for it: leave .grad untouched
            p = entry.ref()
            if p is None:
                continue  # collected here, still alive on another process
            state = entry.state
            if state == _FRESH:
                p.grad.copy_(summed)
            elif p.grad is None:
                p.grad = summed.clone()
            else:
                p.grad.add_(summed)
        return gone

    def _reset(self) -> None:
        # Every bucket was sent, with every deferred part (``_launch``): nothing is left local.
        self._unreduced.clear()
        self._held.clear()
        self._deferred_pass = False
        for bucket in self._buckets:
            bucket.ready = 0
        for entry in self._entries:
            entry.state = 0
        self._next_launch = 0

    def forget_step(self) -> None:
        """Drop what the step under way had launched or gathered (its collectives failed: a
        peer was lost), so that the step can run again on a new group from its start."""
        for bucket in self._buckets:
            bucket.pending, bucket.complete = None, False
        self._in_backward = False
        self._reset()

    def remove(self) -> None:
        """Detach every hook (the strategy is done with these parameters)."""
        for entry in self._entries:
            for handle in entry.handles:
                handle.remove()
            entry.handles.clear()
