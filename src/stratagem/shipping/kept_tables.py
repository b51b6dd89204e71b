"""A table a worker keeps from call to call, on both sides: a loop's function sends it once.

A table of plain data alone (a ``fingerprint`` per entry: ``kept_descriptions``) gets a number
on the chief (``TableNumbers``: the same table, the same number). Per worker, the chief
remembers the last table it sent (``SentTables.to_send``): a run whose table is that one is
sent as its number; one with the same entries, some changed (fit's step counter), as those
entries and the number of the table they change; any other whole. The worker keeps the last
numbered table it was sent and makes each run's table from what came (``KeptTable.receive``).
Neither side is thread-safe: the chief numbers under its lock, and each worker's runs are sent
and received in order, on one connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class TableNumbers:
    """The chief's numbers of its tables: the last table's when a table is the same as it, a
    new one (``new_number()``) else."""

    def __init__(self) -> None:
        # The last table's fingerprints and its number.
        self._last: tuple[dict[str, bytes], int] | None = None

    def number(
        self, fingerprint: dict[str, bytes] | None, new_number: Callable[[], int]
    ) -> int | None:
        """The number of a function's table; None for a table a worker may not keep
        (``fingerprint`` None)."""
        if fingerprint is None:
            return None
        last = self._last
        if last is not None and (last[0] is fingerprint or last[0] == fingerprint):
            return last[1]
        self._last = (fingerprint, new_number())
        return self._last[1]


class Sending(NamedTuple):
    """What a run sends of its table: ``table`` (whole, its changed entries, or None for its
    number alone) and, for changes, ``changes_to`` (the kept table's number)."""

    table: dict[str, Any] | None
    changes_to: int | None
    how: str  # "whole", "number" or "changes"


class SentTables:
    """The chief's record of the table one worker keeps (the last it was sent)."""

    def __init__(self) -> None:
        self._number: int | None = None
        self._entries: dict[str, bytes] | None = None

    def to_send(
        self, table: dict[str, Any], number: int | None, entries: dict[str, bytes] | None
    ) -> Sending:
        """What to send of ``table`` (its ``number`` and ``entries``' fingerprints, None where
        the worker may not keep it); the worker keeps it from then on."""
        kept_id, kept_entries = self._number, self._entries
        sending = Sending(table, None, "whole")
        if number is not None and kept_id == number:
            sending = Sending(None, None, "number")  # the worker has this table
        elif (
            entries is not None
            and kept_entries is not None
            and entries.keys() == kept_entries.keys()
        ):
            # The same entries as the table the worker keeps, some changed (a step counter of
            # fit's): those alone, and the number of the table they change.
            changes = {k: table[k] for k, f in entries.items() if kept_entries[k] != f}
            sending = Sending(changes, kept_id, "changes")
        self._number, self._entries = number, entries
        return sending


class Received(NamedTuple):
    """A run's table as a worker made it from what came: sent by number, or as ``changes``
    (the entries sent) to the kept one."""

    table: Any
    by_number: bool
    changes: dict[str, Any] | None


class KeptTable:
    """A worker's side: the last numbered table it was sent (``me`` names it in errors)."""

    def __init__(self, me: str) -> None:
        self._me = me
        self._kept: tuple[int, Any] | None = None  # (its number, the table)

    def receive(self, table: Any, table_id: Any, changes_to: Any = None) -> Received:
        """A run's table: the one sent, kept when it has a number (plain data alone: the
        rebuild only reads it); the one kept when the chief sent only its number (the next
        function of a loop, whose table is the last one's); or, with ``changes_to`` (the kept
        table's number), the kept one with the entries sent in place of its own (a loop's
        counter changed). In the order the chief's runs arrive (the connection's thread)."""
        by_number = table is None and changes_to is None
        sent_changes = table if changes_to is not None else None
        if table_id is not None and type(table_id) is not int:
            raise ValueError(f"a table's number is an int or None; got {table_id!r}")
        kept_id, kept = self._kept or (None, None)
        if changes_to is not None:
            if type(changes_to) is not int or kept_id != changes_to or not isinstance(table, dict):
                raise ValueError(
                    f"the chief sent changes to table {changes_to!r} for {self._me}; it keeps "
                    f"table {kept_id}"
                )
            table = {**kept, **table}
        if table is None:
            if table_id is None or kept_id != table_id:
                raise ValueError(
                    f"the chief sent the number of table {table_id} for {self._me} to use "
                    f"again; it keeps table {kept_id}"
                )
            return Received(kept, by_number, sent_changes)
        self._kept = None if table_id is None else (table_id, table)
        return Received(table, by_number, sent_changes)
