"""The chief's descriptions of a scheduled call, kept while nothing they read has changed.

``KeptDescriptions.describe(fn, args, kwargs)`` returns a ``Description`` of the call (its
table, the function's reference, its arguments' entries, its accumulators, and the table's
``fingerprint``): the last one of ``fn`` where it is the same call (by identity) and the
snapshot of everything its describe read (``unchanged.Reads``) is unchanged, with its volatile
attributes read again; else a new one, made with the caller's describer (its specials). With
``STRATAGEM_CHECK_KEPT_DESCRIPTIONS=1`` every kept description is checked against a new one.
Thread-safe: ``schedule`` may be called from several threads.
"""

from __future__ import annotations

import copy
import operator
import os
import threading
from collections.abc import Callable
from typing import Any

from stratagem.shipping.describe import Describer
from stratagem.shipping.portable import VOLATILE_TYPES
from stratagem.shipping.program import source_line
from stratagem.shipping.unchanged import Reads, Snapshot, plain_bytes

_UNWATCHED = 64  # see Description
_ABSENT = object()
_KEPT_FUNCTIONS = 8  # descriptions kept: the last of each of the last functions scheduled


def fingerprint(table: dict[str, Any]) -> dict[str, bytes] | None:
    """Per entry of a table, its ``plain_bytes``; None for a table a worker may not keep from
    call to call (a tensor in it: a captured one, a buffer's value, a dataset's data, which a
    call may change)."""
    fingerprint: dict[str, bytes] = {}
    for key, entry in table.items():
        data = plain_bytes(entry)
        if data is None:
            return None
        fingerprint[key] = data
    return fingerprint


class Description:
    """A schedule's description (its table, the function's reference, its arguments' entries,
    its accumulators and fingerprint), kept for the next ``schedule`` of the same function and
    arguments (by identity) while a snapshot of everything the describe read is unchanged
    (``Reads``): describing again would make the same.

    The values of volatile attributes (``Portable._sg_volatile``: fit's step counter) are not
    watched but read again at each call and put in the table (``refreshed``). Recording the
    reads and taking the snapshot cost about half a describe more. A description that cannot be
    kept (a tensor by value in it) or whose reads changed at two calls in a row (a loop that
    changes what its function captures at every call) is not watched for the next
    ``_UNWATCHED`` calls of its function (``KeptDescriptions``); then it is tried again."""

    def __init__(
        self,
        fn: Any,
        args: tuple,
        kwargs: dict[str, Any],
        name: str,
        describer: Describer,
        call: tuple[Any, list[Any], dict[str, Any]],
        fingerprint: dict[str, bytes] | None,
        snapshot: Snapshot | None,
        volatile: list[tuple[str, Any, str]],
    ) -> None:
        self.fn = fn
        self.args = tuple(args)  # copies: a caller may change the list or dict it passed
        self.kwargs = dict(kwargs)
        self.name = name
        self.table = describer.functions
        self.accumulators = describer.accumulators
        self.ref, self.call_args, self.call_kwargs = call
        self.fingerprint = fingerprint  # None: a tensor in the table
        self.snapshot = snapshot  # None: not to be kept
        self.volatile = volatile  # (table key, object, attribute): read again at each call
        self.changed = 0  # calls in a row, with the same arguments, that found it changed

    def refreshed(self) -> Description | None:
        """This description with the values its volatile attributes have now (a step
        counter's); None where one is no longer a number, a string or None."""
        patches: dict[str, dict[str, Any]] = {}
        for key, obj, attribute in self.volatile:
            now = vars(obj).get(attribute, _ABSENT)
            if type(now) not in VOLATILE_TYPES:
                return None
            entry = patches.get(key) or self.table[key]
            was = entry["state"].get(attribute)
            if was is None:
                continue  # local to each process: not described
            if was.get("k") != "value":
                return None  # it held something else when described
            if was["v"] is now:
                continue
            state = {**entry["state"], attribute: {"k": "value", "v": now}}
            patches[key] = {**entry, "state": state}
        if not patches:
            return self
        fresh = copy.copy(self)
        fresh.table = {**self.table, **patches}
        fresh.fingerprint = {
            **(self.fingerprint or {}),
            **(fingerprint(patches) or {}),  # (plain: a kept table's entries, a number)
        }
        return fresh

    def same_call(self, fn: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
        return (
            fn is self.fn
            and len(args) == len(self.args)
            and all(map(operator.is_, args, self.args))
            and kwargs.keys() == self.kwargs.keys()
            and all(kwargs[k] is v for k, v in self.kwargs.items())
        )


class KeptDescriptions:
    """The last description of each of the last functions scheduled; ``describer(reads)``
    makes the caller's describer (its specials), recording what it reads in ``reads``."""

    def __init__(self, describer: Callable[[Reads | None], Describer]) -> None:
        self._describer = describer
        self._kept: dict[int, Description] = {}  # id(function) -> its last description
        self._unwatched: dict[int, int] = {}  # id(function) -> calls still to describe afresh
        self._lock = threading.Lock()  # schedule may be called from several threads
        self.used = 0  # schedules that used the last one's description
        # A check for tests: describe every function again where the last description is kept,
        # and raise if the two differ.
        self._check = os.environ.get("STRATAGEM_CHECK_KEPT_DESCRIPTIONS") == "1"

    def kept_of(self, fn: Any) -> Description | None:
        """The description kept for ``fn`` (None: none is)."""
        return self._kept.get(id(fn))

    def describe(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Description:
        """``fn(*args, **kwargs)`` described: the last description of ``fn`` where it is the
        same call and nothing it read has changed, else a new one (kept, and watched, as
        ``Description`` says)."""
        key = id(fn)  # (a kept description holds its function: the id stays its own)
        with self._lock:
            skip = self._unwatched.pop(key, 0)
            if skip > 1:
                self._unwatched[key] = skip - 1
            if skip:
                return self._describe(fn, args, kwargs, watch=False)
            kept = self._kept.pop(key, None)
            changed = 0
            if kept is not None and kept.snapshot is not None and kept.same_call(fn, args, kwargs):
                current = kept.refreshed() if kept.snapshot.unchanged() else None
                if current is not None:
                    self._kept[key] = current  # the most recent again
                    self.used += 1
                    if self._check:
                        self._check_kept(current)
                    return current
                changed = kept.changed + 1
            described = self._describe(fn, args, kwargs, watch=changed < 2)
            if described.snapshot is None:
                if len(self._unwatched) >= 4 * _KEPT_FUNCTIONS:
                    self._unwatched.clear()  # (ids of functions long gone, perhaps)
                self._unwatched[key] = _UNWATCHED
                return described
            described.changed = changed
            if len(self._kept) >= _KEPT_FUNCTIONS:
                del self._kept[next(iter(self._kept))]  # the function scheduled longest ago
            self._kept[key] = described
            return described

    def _describe(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], *, watch: bool
    ) -> Description:
        """Describe ``fn(*args, **kwargs)``; with ``watch``, with a snapshot of what was read
        where the description may be kept (no tensor by value in it, every read recorded)."""
        name = source_line(fn)
        reads = Reads() if watch else None
        describer = self._describer(reads)
        ref = describer.function(fn, what=name)
        call_args = [
            describer.value(a, owner=name, name=f"argument {i}") for i, a in enumerate(args)
        ]
        call_kwargs = {
            k: describer.value(v, owner=name, name=f"argument {k!r}") for k, v in kwargs.items()
        }
        call = (ref, call_args, call_kwargs)
        table_fingerprint = fingerprint(describer.functions)
        snapshot = None
        if reads is not None and table_fingerprint is not None and plain_bytes(call) is not None:
            snapshot = reads.snapshot()
        volatile = reads.volatile if reads is not None else []
        return Description(
            fn, args, kwargs, name, describer, call, table_fingerprint, snapshot, volatile
        )

    def _check_kept(self, kept: Description) -> None:
        """``STRATAGEM_CHECK_KEPT_DESCRIPTIONS=1``: the kept description is what a new one
        would be, or an ``AssertionError`` names the first difference."""
        fresh = self._describe(kept.fn, kept.args, kept.kwargs, watch=False)
        then, now = kept.fingerprint or {}, fresh.fingerprint or {}
        differences = [
            f"table entry {k}: kept {kept.table.get(k)!r}, new {fresh.table.get(k)!r}"
            for k in sorted({*then, *now})
            if then.get(k) != now.get(k)
        ]
        calls = [(kept.ref, kept.call_args, kept.call_kwargs), (fresh.ref, fresh.call_args,
                 fresh.call_kwargs)]  # fmt: skip
        if plain_bytes(calls[0]) != plain_bytes(calls[1]):
            differences.append(f"the function and arguments: kept {calls[0]!r}, new {calls[1]!r}")
        if kept.accumulators.keys() != fresh.accumulators.keys() or any(
            fresh.accumulators[k] is not v for k, v in kept.accumulators.items()
        ):
            differences.append("the accumulators")
        if differences:
            raise AssertionError(
                f"schedule({kept.name}) kept the last description, but a new one differs: "
                + "; ".join(differences)
            )
