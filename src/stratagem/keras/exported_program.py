"""The ``torch.export`` program of a saved model, written and read without unpickling anything.

``torch.export.load`` is not safe on untrusted files: it unpickles a weight or constant stored
as a tensor subclass, a custom or opaque object, and example inputs that ``weights_only=True``
refuses; an archive may also carry AOTInductor shared libraries. So before handing an archive to
it, we check what the archive holds: only the files of a plain program (the graph as JSON,
weights and constants as raw bytes, example inputs that load with ``weights_only=True``), and
nothing that would be unpickled. Anything else is refused, naming the file. A program stratagem
wrote always passes: its weights are plain tensors.
"""

from __future__ import annotations

import copy
import io
import json
import re
import zipfile
from collections.abc import Mapping
from typing import BinaryIO

import torch
from torch.utils import _pytree as pytree

__all__ = ["ProgramError", "export_program", "load_program"]


class ProgramError(ValueError):
    """A program archive holds something that loading it would unpickle or run."""


# The files of a torch.export archive (torch 2.13, ``torch.export.pt2_archive``) under its one
# top-level folder: bookkeeping, the graph, raw weight and constant bytes, their configs, and
# the example inputs (a torch.save file, checked apart).
_ALLOWED = re.compile(
    r"^(?:archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id|"
    r"models/[\w.-]+\.json|data/weights/weight_\d+|data/weights/[\w.-]+_weights_config\.json|"
    r"data/constants/tensor_\d+|data/constants/[\w.-]+_constants_config\.json|"
    r"data/sample_inputs/[\w.-]+\.pt)$"
)


def export_program(module: torch.nn.Module, example: torch.Tensor, target: BinaryIO) -> list[str]:
    """Export ``module`` (in eval mode) traced on ``example``, its first dimension dynamic.
    Returns the names of the outputs the program leaves out: entries of a dict-like output
    (a Hugging Face ``ModelOutput``) holding objects torch.export cannot carry, such as a
    language model's cache; the rest of the output is exported."""
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad():
            dropped = _unexportable(module(example))
        traced = _without_outputs(module, dropped) if dropped else module
        batch = torch.export.Dim("batch")
        program = torch.export.export(traced, (example,), dynamic_shapes=({0: batch},))
        torch.export.save(program, target)
    finally:
        module.train(was_training)
    return dropped


def _unexportable(output: object) -> list[str]:
    """The keys of a dict-like output whose values are not tensors (nor containers of them)."""
    if not isinstance(output, Mapping):
        return []

    def plain(leaf: object) -> bool:
        return leaf is None or isinstance(leaf, torch.Tensor | bool | int | float)

    return [str(k) for k, v in output.items() if not all(map(plain, pytree.tree_leaves(v)))]


def _without_outputs(module: torch.nn.Module, dropped: list[str]) -> torch.nn.Module:
    """A module sharing ``module``'s submodules and weights (so the program's weight names are
    the module's own) whose forward leaves out the outputs ``dropped``."""
    forward = module.forward
    view = copy.copy(module)  # a shallow copy: the same parameter and submodule dicts

    def kept(x: torch.Tensor) -> object:
        out = forward(x)
        return type(out)(**{k: v for k, v in out.items() if k not in dropped})

    view.forward = kept  # type: ignore[method-assign]
    return view


def load_program(file: BinaryIO, name: str) -> torch.nn.Module:
    """The module of the program archive ``file`` (``name`` is for messages), after checking
    that loading it unpickles nothing."""
    data = file.read()
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = archive.namelist()
    except zipfile.BadZipFile as e:
        raise ProgramError(f"{name!r} is not a torch.export program archive: {e}") from e
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1:
        raise ProgramError(f"{name!r}: expected one top-level folder, found {sorted(roots)}")
    for entry in names:
        inner = entry.split("/", 1)[1] if "/" in entry else ""
        if entry.endswith("/"):
            continue
        if not _ALLOWED.match(inner):
            raise ProgramError(
                f"{name!r} holds {entry!r}, which is not part of a plain torch.export program "
                f"(graph, raw weights, constants, example inputs); refusing to load it, as "
                f"torch.export.load could unpickle or run it"
            )
        if inner.endswith("_config.json"):
            _check_payload_config(name, entry, archive.read(entry))
        elif inner.startswith("data/sample_inputs/"):
            try:  # torch.export.load would retry a refusal with weights_only=False
                torch.load(io.BytesIO(archive.read(entry)), weights_only=True)
            except Exception as e:
                raise ProgramError(
                    f"{name!r}: the example inputs {entry!r} do not load with "
                    f"torch.load(weights_only=True) ({e}); refusing to unpickle them"
                ) from e
    try:
        return torch.export.load(io.BytesIO(data)).module()
    except Exception as e:
        raise ProgramError(f"cannot read the exported program {name!r}: {e}") from e


def _check_payload_config(name: str, entry: str, text: bytes) -> None:
    """A weights or constants config: every payload raw bytes, none pickled."""
    try:
        config = json.loads(text)["config"]
        payloads = list(config.items())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ProgramError(f"{name!r}: {entry!r} is not a payload config ({e})") from e
    for key, payload in payloads:
        if not isinstance(payload, dict) or payload.get("use_pickle") is not False:
            raise ProgramError(
                f"{name!r}: {entry!r} stores {key!r} pickled; refusing to unpickle it"
            )
        if not re.fullmatch(r"(?:weight|tensor)_\d+", str(payload.get("path_name"))):
            raise ProgramError(
                f"{name!r}: {entry!r} stores {key!r} as {payload.get('path_name')!r}, not as "
                f"raw tensor bytes; refusing to load it"
            )
