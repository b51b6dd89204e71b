"""What processes may send each other as "objects": plain data and tensors, never pickles.

A value (``Communicator.all_gather_object``, ``comm.messages``) travels as one frame of a fixed
schema, and decoding it runs nothing a peer chose:

    b"SGO1" | header length (8 bytes, little-endian) | header (UTF-8 JSON) | tensor bytes

The header is ``{"value": ..., "tensors": [[dtype, shape], ...]}``. ``value`` is JSON of
``None``, ``bool``, ``int``, ``float``, ``str``, lists and dicts with ``str`` keys; a tuple is
``{"__sg__": "tuple", "items": [...]}`` (so it comes back a tuple) and a tensor is
``{"__sg__": "tensor", "index": i}``, whose raw bytes follow the header in table order. Tensors
arrive on the CPU. Anything else is refused at the sender; a frame that does not fit the schema
is a ``PeerDataError`` naming the peer and the operation.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stratagem.errors import PeerDataError

_MAGIC = b"SGO1"
_TAG = "__sg__"
# The JSON part is parsed whole into Python objects; a bound keeps a peer from making that cost
# gigabytes. Tensor bytes are bounded by the frame limit (``max_frame_bytes``) instead.
MAX_HEADER_BYTES = 64 << 20
_DEFAULT_MAX_FRAME = 4 << 30

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}

_DTYPE_SET = frozenset(_DTYPES.values())


def max_frame_bytes() -> int:
    """The largest frame a process accepts: ``STRATAGEM_MAX_OBJECT_BYTES``, else 4 GiB."""
    raw = os.environ.get("STRATAGEM_MAX_OBJECT_BYTES", "")
    if raw == "":
        return _DEFAULT_MAX_FRAME
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"STRATAGEM_MAX_OBJECT_BYTES={raw!r} is not a number of bytes") from None
    if value <= 0:
        raise ValueError(f"STRATAGEM_MAX_OBJECT_BYTES={raw!r} must be a positive number of bytes")
    return value


# ---------------------------------------------------------------------------------- sending


def check_announced_size(size: int, *, sender: str, what: str) -> None:
    """Refuse a frame size a peer announced before anything is allocated for it: a peer cannot
    make us reserve memory beyond the bound, and a too-large honest frame fails alike
    everywhere."""
    limit = max_frame_bytes()
    if not 0 < size <= limit:
        raise PeerDataError(
            f"{sender} announced {size} bytes for the exchange of {what}; a frame has between "
            f"1 and {limit} bytes (STRATAGEM_MAX_OBJECT_BYTES)"
        )


def encode(obj: Any, *, what: str) -> bytes:
    """``obj`` as one frame; a ``TypeError`` naming the offending part if it is not plain data."""
    head, tensors = encode_parts(obj, what=what)
    return b"".join([head] + [_tensor_bytes(t) for t in tensors])


def encode_parts(obj: Any, *, what: str) -> tuple[bytes, list[torch.Tensor]]:
    """``encode``'s frame as its head (marker, header length, header) and the tensors whose raw
    bytes follow it, contiguous and on the CPU: a sender writes their memory as it is
    (``tensor_buffer``) instead of copying it into one joined frame."""
    tensors: list[torch.Tensor] = []
    value = _to_json(obj, tensors, what=what, path="value")
    tensors = [t.cpu().contiguous() for t in tensors]
    table = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    header = json.dumps({"value": value, "tensors": table}, separators=(",", ":")).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(
            f"the plain data of {what} is {len(header)} bytes of JSON, more than the "
            f"{MAX_HEADER_BYTES} a value sent between processes may hold; send large data as "
            "tensors"
        )
    return _MAGIC + len(header).to_bytes(8, "little") + header, tensors


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (writable: a receiver fills a
    tensor it allocated through it)."""
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype is torch.bfloat16:  # numpy has no bfloat16: its bytes through a uint8 view
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    # One torch call, not three: a ps answers every push with a buffer per tensor, and the
    # reshape-view-numpy way was an eighth of its CPU.
    return memoryview(t.numpy()).cast("B")


def check(obj: Any, *, what: str) -> None:
    """Raise the ``TypeError`` ``encode`` would, without copying any tensor."""
    _to_json(obj, [], what=what, path="value")


# The exact types a value's leaves are sent as they are (their subclasses are sent as these).
EXACT_PLAIN = frozenset({type(None), bool, int, float, str})


class _NotPlain(Exception):
    """Raised inside the walk: ``message(path_text)`` is the ``TypeError``'s text; each level it
    passes through adds its key, so a path is made into text only for an error (formatting
    every element's path up front was a third of a coordinator's CPU per scheduled function)."""

    def __init__(self, message: Callable[[str], str]) -> None:
        self.message = message
        self.keys: list[Any] = []  # innermost first


def _to_json(obj: Any, tensors: list[torch.Tensor], *, what: str, path: str) -> Any:
    try:
        return _plain(obj, tensors)
    except _NotPlain as e:
        text = path + "".join(f"[{k!r}]" for k in reversed(e.keys))
        raise TypeError(f"{what}: {e.message(text)}") from None


def _plain(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` as JSON's types, its tensors moved to ``tensors`` (tagged by index). Leaves of
    the exact plain types are taken where they sit, without a call: most of a value is leaves."""
    kind = type(obj)
    # The exact plain types first (nearly everything sent); then their subclasses (an
    # OrderedDict state dict, a float64 numpy scalar, an IntEnum), sent as their plain base
    # type: the receiver never sees the subclass.
    if kind in EXACT_PLAIN:
        return obj
    if kind is dict:
        return _plain_dict(obj, tensors)
    if kind is list:
        return _plain_items(obj, tensors)
    if isinstance(obj, int):  # bool has no subclasses: it was returned above
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "items": _plain_items(obj, tensors)}
    if isinstance(obj, list):
        return _plain_items(obj, tensors)
    if isinstance(obj, dict):
        return _plain_dict(obj, tensors)
    if isinstance(obj, torch.Tensor):
        tensors.append(_checked_tensor(obj))
        return {_TAG: "tensor", "index": len(tensors) - 1}
    raise _NotPlain(
        lambda at: (
            f"{at} is a {kind.__module__}.{kind.__qualname__}; a value sent between "
            "processes holds only None, bool, int, float, str, lists, tuples, dicts with str "
            "keys and dense tensors (nothing is pickled)"
        )
    )


def _plain_items(items: list | tuple, tensors: list[torch.Tensor]) -> list[Any]:
    out = []
    for i, v in enumerate(items):
        if type(v) in EXACT_PLAIN:
            out.append(v)
            continue
        try:
            out.append(_plain(v, tensors))
        except _NotPlain as e:
            e.keys.append(i)
            raise
    return out


def _plain_dict(obj: dict, tensors: list[torch.Tensor]) -> dict[str, Any]:
    out = {}
    for k, v in obj.items():
        if type(k) is not str or k == _TAG:
            k = _plain_key(k)
        if type(v) in EXACT_PLAIN:
            out[k] = v
            continue
        try:
            out[k] = _plain(v, tensors)
        except _NotPlain as e:
            e.keys.append(k)
            raise
    return out


def _plain_key(k: Any) -> str:
    """A key that is not exactly a ``str`` other than the tag: a ``str`` subclass's text."""
    if not isinstance(k, str) or k == _TAG:
        raise _NotPlain(
            lambda at: (
                f"{at} has the key {k!r}; a value sent between processes holds "
                f"dicts with str keys other than {_TAG!r} only"
            )
        )
    return str(k)


def _checked_tensor(t: torch.Tensor) -> torch.Tensor:
    plain = t.detach()
    if type(plain) is not torch.Tensor or plain.layout is not torch.strided:
        raise _NotPlain(
            lambda at: (
                f"{at} is a {type(t).__name__} with layout {t.layout}; a value sent "
                "between processes holds dense tensors only"
            )
        )
    if plain.dtype not in _DTYPE_SET:
        raise _NotPlain(
            lambda at: (
                f"{at} has dtype {plain.dtype}; a value sent between processes holds "
                f"tensors of {', '.join(_DTYPES)} only"
            )
        )
    return plain


def _tensor_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------- receiving


def _refuser(sender: str, what: str) -> Callable[[str], PeerDataError]:
    def refuse(why: str) -> PeerDataError:
        return PeerDataError(
            f"{sender} sent data that is not plain data during the exchange of {what}: {why}. "
            "Object exchanges carry JSON and tensors only; a process running another version "
            "of stratagem, or one that is not part of this job, sends such data"
        )

    return refuse


def decode(frame: bytes, *, sender: str, what: str) -> Any:
    """The value in ``frame``, which ``sender`` sent for ``what``; ``PeerDataError`` if it is
    not a frame of the schema. Nothing is unpickled or imported."""
    refuse = _refuser(sender, what)
    if frame[:4] != _MAGIC:
        raise refuse(f"it starts with {bytes(frame[:16])!r}, not the frame marker {_MAGIC!r}")
    if len(frame) < 12:
        raise refuse(f"the frame is {len(frame)} bytes, shorter than its 12-byte preamble")
    size = int.from_bytes(frame[4:12], "little")
    if size > MAX_HEADER_BYTES or 12 + size > len(frame):
        raise refuse(
            f"its header claims {size} bytes; the frame holds {len(frame) - 12} after the "
            f"preamble and a header may have at most {MAX_HEADER_BYTES}"
        )
    header, tags = _parse_header(bytes(frame[12 : 12 + size]), refuse)
    if not isinstance(header, dict) or set(header) != {"value", "tensors"}:
        raise refuse("its header is not an object with exactly 'value' and 'tensors'")
    tensors = _read_tensors(header["tensors"], memoryview(frame)[12 + size :], refuse)
    return _value(header, tags, tensors, refuse)


def _tensor_table(table: Any, refuse: Any) -> list[tuple[torch.dtype, list[int], int]]:
    """A header's tensor table as ``(dtype, shape, bytes)`` per tensor, checked."""
    if not isinstance(table, list):
        raise refuse(f"its tensor table is a {type(table).__name__}, not a list")
    out = []
    for i, entry in enumerate(table):
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not isinstance(entry[0], str)
            or not isinstance(entry[1], list)
            or not all(type(n) is int and n >= 0 for n in entry[1])
        ):
            raise refuse(f"tensor {i} is described as {entry!r}, not [dtype, [sizes...]]")
        dtype = _DTYPES.get(entry[0])
        if dtype is None:
            raise refuse(f"tensor {i} has dtype {entry[0]!r}; expected one of {list(_DTYPES)}")
        nbytes = math.prod(entry[1]) * dtype.itemsize
        out.append((dtype, entry[1], nbytes))
    return out


def read_frame(
    read_into: Callable[[memoryview], None],
    *,
    sender: str,
    what: str,
    read_tensors_into: Callable[[memoryview], None] | None = None,
    into: Sequence[torch.Tensor] = (),
    lend: Callable[[torch.dtype, list[int], int], torch.Tensor] | None = None,
    kept: list[torch.Tensor] | None = None,
) -> Any:
    """The value of one frame read from a stream, as ``decode`` would give it: ``read_into(b)``
    fills the buffer ``b`` whole (or raises). The header is checked before any tensor is
    allocated, and each tensor's bytes are read straight into the tensor that holds them: no
    frame-sized buffer, no copy. ``read_tensors_into``, when given, fills the tensors instead
    (their bytes came another way, such as shared memory).

    ``into`` offers the frame's tensors a home, by position: the i-th tensor of the frame is
    read into ``into[i]`` when that has its dtype and shape and is contiguous (memory already in
    use takes the bytes without the page faults of a fresh allocation, and a caller can receive
    straight into its own tensors); otherwise, as when ``into`` is shorter, into a new tensor.
    ``lend(dtype, shape, nbytes)``, when given, gives each tensor instead, as a view of memory
    the transport lends (no copy at all; valid only until its next frame). ``kept``, when
    given, gets the frame's tensors in order (a server offers them to the next request as
    ``into``, without walking the value to find them)."""
    refuse = _refuser(sender, what)
    preamble = bytearray(12)
    read_into(memoryview(preamble))
    if preamble[:4] != _MAGIC:
        raise refuse(f"it starts with {bytes(preamble)!r}, not the frame marker {_MAGIC!r}")
    size = int.from_bytes(preamble[4:12], "little")
    if size > MAX_HEADER_BYTES:
        raise refuse(f"its header claims {size} bytes; a header has at most {MAX_HEADER_BYTES}")
    raw = bytearray(size)
    read_into(memoryview(raw))
    header, tags = _parse_header(raw, refuse)
    if not isinstance(header, dict) or set(header) != {"value", "tensors"}:
        raise refuse("its header is not an object with exactly 'value' and 'tensors'")
    table = _tensor_table(header["tensors"], refuse)
    check_announced_size(12 + size + sum(n for _, _, n in table), sender=sender, what=what)
    tensors = []
    for i, (dtype, shape, nbytes) in enumerate(table):
        if lend is not None and nbytes:
            tensors.append(lend(dtype, shape, nbytes))
            continue
        t = into[i] if i < len(into) and _fits(into[i], dtype, shape) else None
        if t is None:
            t = torch.empty(shape, dtype=dtype)
        if nbytes:
            (read_tensors_into or read_into)(tensor_buffer(t))
        tensors.append(t)
    if kept is not None:
        kept.extend(tensors)
    return _value(header, tags, tensors, refuse)


def _fits(t: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> bool:
    return (
        t.dtype == dtype
        and list(t.shape) == shape
        and t.device.type == "cpu"
        and t.is_contiguous()
        and not t.requires_grad
    )


def _read_tensors(table: Any, body: memoryview, refuse: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    offset = 0
    for i, (dtype, shape, nbytes) in enumerate(_tensor_table(table, refuse)):
        entry = [str(dtype).removeprefix("torch."), shape]
        numel = math.prod(shape)
        if offset + nbytes > len(body):
            raise refuse(
                f"tensor {i} ({entry[0]} {entry[1]}) needs {nbytes} bytes but only "
                f"{len(body) - offset} are left in the frame"
            )
        if numel == 0:
            out.append(torch.empty(entry[1], dtype=dtype))
        else:
            raw = bytearray(body[offset : offset + nbytes])
            out.append(torch.frombuffer(raw, dtype=dtype).reshape(entry[1]))
        offset += nbytes
    if offset != len(body):
        raise refuse(f"{len(body) - offset} bytes follow the last tensor")
    return out


class _TensorAt:
    """A tagged tensor as the parse finds it, before the frame's tensors are read."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Tags:
    """The JSON parser's hook for objects: a tagged tuple is made at once, a tagged tensor is
    noted (``_TensorAt``) and counted; any other tag is refused. JSON's own parser calls it for
    each object, bottom up, so a value without tensors needs no walk of ours afterwards
    (walking every element in Python was most of the cost of receiving a scheduled function)."""

    def __init__(self, refuse: Callable[[str], PeerDataError]) -> None:
        self.refuse = refuse
        self.tensors = 0

    def __call__(self, value: dict[str, Any]) -> Any:
        if _TAG not in value:
            return value
        tag = value[_TAG]
        if len(value) == 2:
            items = value.get("items")
            if tag == "tuple" and type(items) is list:
                return tuple(items)
            index = value.get("index")
            if tag == "tensor" and type(index) is int:
                self.tensors += 1
                return _TensorAt(index)
        raise self.refuse(
            f"it holds the tagged value {_shorten(value)}, which is no tuple or tensor"
        )


def _parse_header(
    raw: bytes | bytearray, refuse: Callable[[str], PeerDataError]
) -> tuple[Any, _Tags]:
    tags = _Tags(refuse)
    try:
        header = json.loads(raw.decode("utf-8"), object_hook=tags)
    except PeerDataError:
        raise  # a tag the hook refused
    except (ValueError, RecursionError) as e:
        raise refuse(f"its header is not JSON ({e})") from None
    return header, tags


def _value(header: dict[str, Any], tags: _Tags, tensors: list[torch.Tensor], refuse: Any) -> Any:
    """A parsed frame's value, with its tensors put in where the parse noted them."""
    if not tags.tensors:
        return header["value"]  # no tensor to put in: the parse made the value whole
    try:
        return _with_tensors(header["value"], tensors, refuse)
    except RecursionError:
        raise refuse("its value is nested too deeply") from None


def _with_tensors(value: Any, tensors: list[torch.Tensor], refuse: Any) -> Any:
    """``value`` with each ``_TensorAt`` replaced by its tensor."""
    kind = type(value)
    if kind is list:
        return [_with_tensors(v, tensors, refuse) for v in value]
    if kind is dict:
        return {k: _with_tensors(v, tensors, refuse) for k, v in value.items()}
    if kind is tuple:
        return tuple(_with_tensors(v, tensors, refuse) for v in value)
    if kind is _TensorAt:
        if 0 <= value.index < len(tensors):
            return tensors[value.index]
        tagged = {_TAG: "tensor", "index": value.index}
        raise refuse(f"it holds the tagged value {_shorten(tagged)}, which is no tuple or tensor")
    return value  # JSON scalars: None, bool, int, float, str


def _shorten(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
