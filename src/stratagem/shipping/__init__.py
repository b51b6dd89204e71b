"""Function shipping: a function, and what it captures, sent by reference to code every task
has, never by value (nothing is pickled, no code travels).

Every task of a job runs the same program. The chief describes a function as *where its code
is* and a hash of its code object (``program``); what it captures travels as a table of plain
data (``describe``): modules and functions by name or reference, tensors and plain data by
value, modules, optimizers and ``Portable`` objects by state (``portable``), objects of a
library's plain class by their attributes (``by_attributes``: a Hugging Face model's config). A
worker rebuilds the function from its own copy of the program (``rebuild``). TF2's
``ClusterCoordinator`` schedules functions this way; the classes that travel by state import
only ``portable``.
"""

from stratagem.shipping.describe import Describer, Special
from stratagem.shipping.entry_points import entry_point, nested_entry_points
from stratagem.shipping.kept_descriptions import Description, KeptDescriptions, fingerprint
from stratagem.shipping.kept_tables import (
    KeptTable,
    Received,
    Sending,
    SentTables,
    TableNumbers,
)
from stratagem.shipping.portable import VOLATILE_TYPES, Portable, add_totals, totals_of
from stratagem.shipping.program import (
    code_hash,
    compute_code_hash,
    file_hash,
    program_file,
    program_root,
    source_line,
)
from stratagem.shipping.rebuild import Rebuilder, ResolveSpecial, dtype_named
from stratagem.shipping.unchanged import Reads, Snapshot, plain_bytes, watch

__all__ = [
    "VOLATILE_TYPES",
    "Describer",
    "Description",
    "KeptDescriptions",
    "KeptTable",
    "Portable",
    "Reads",
    "Rebuilder",
    "Received",
    "ResolveSpecial",
    "Sending",
    "SentTables",
    "Snapshot",
    "Special",
    "TableNumbers",
    "add_totals",
    "code_hash",
    "compute_code_hash",
    "dtype_named",
    "entry_point",
    "file_hash",
    "fingerprint",
    "nested_entry_points",
    "plain_bytes",
    "program_file",
    "program_root",
    "source_line",
    "totals_of",
    "watch",
]
