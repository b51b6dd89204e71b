"""Restoring saved state into live objects: checks that name what differs, and ``LoadStatus``.

A restore first checks every saved value against the object it is meant for (shapes, dtypes,
keys, parameter groups) and only then loads any, so a mismatch leaves every object as it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from stratagem.errors import CheckpointError, CheckpointMatchError


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def few(items: list[str], limit: int = 8) -> str:
    """``items`` for an error message, cut after ``limit`` entries."""
    shown = ", ".join(repr(i) for i in items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


class RestoreReport:
    """What a restore has matched so far; becomes the ``LoadStatus``."""

    def __init__(self) -> None:
        self.unused: list[str] = []
        self.unrestored: list[str] = []
        self.matched = 0


def check_tensor(name: str, target: torch.Tensor, saved: object, path: str) -> torch.Tensor:
    if not isinstance(saved, torch.Tensor):
        raise CheckpointError(
            f"cannot restore tensor {name!r} from {path!r}: saved value is a "
            f"{type(saved).__name__}, expected a tensor"
        )
    if saved.shape != target.shape or saved.dtype != target.dtype:
        raise CheckpointError(
            f"cannot restore tensor {name!r} from {path!r}: saved shape {list(saved.shape)} "
            f"dtype {dtype_name(saved.dtype)}, tracked tensor has shape {list(target.shape)} "
            f"dtype {dtype_name(target.dtype)}"
        )
    return saved


def copy_into(target: torch.Tensor, saved: torch.Tensor) -> None:
    # In place, so every reference the program holds (a loop's `epoch`) sees the restored value.
    with torch.no_grad():
        target.copy_(saved)


def check_module(name: str, module: torch.nn.Module, saved: object, path: str) -> None:
    if not isinstance(saved, Mapping):
        raise CheckpointError(
            f"cannot restore module {name!r} from {path!r}: saved value is a "
            f"{type(saved).__name__}, expected a state_dict"
        )
    current = module.state_dict()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing or unexpected:
        raise CheckpointError(
            f"cannot restore module {name!r} ({type(module).__name__}) from {path!r}: "
            f"missing keys [{few(missing)}], unexpected keys [{few(unexpected)}]"
        )
    wrong = [
        f"{k}: saved {list(saved[k].shape)}, module has {list(v.shape)}"
        for k, v in current.items()
        if isinstance(v, torch.Tensor)
        and isinstance(saved[k], torch.Tensor)
        and saved[k].shape != v.shape
    ]
    if wrong:
        raise CheckpointError(
            f"cannot restore module {name!r} ({type(module).__name__}) from {path!r}: "
            f"shape mismatch for {'; '.join(wrong)}"
        )


def check_optimizer(name: str, opt: torch.optim.Optimizer, saved: object, path: str) -> None:
    if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= set(saved):
        raise CheckpointError(
            f"cannot restore optimizer {name!r} from {path!r}: expected an optimizer state_dict "
            f"with 'state' and 'param_groups', found {type(saved).__name__}"
        )
    have = [len(g["params"]) for g in opt.param_groups]
    got = [len(g.get("params", ())) for g in saved["param_groups"]]
    if have != got:
        raise CheckpointError(
            f"cannot restore optimizer {name!r} ({type(opt).__name__}) from {path!r}: saved "
            f"parameter groups hold {got} parameters, the optimizer's hold {have}"
        )


def load_into(name: str, obj: Any, saved: Any, path: str) -> None:
    try:
        obj.load_state_dict(saved)
    except Exception as e:
        raise CheckpointError(
            f"cannot restore {name!r} ({type(obj).__name__}) from {path!r}: {e}"
        ) from e


class LoadStatus:
    """What a restore matched; TensorFlow's ``CheckpointLoadStatus``.

    ``unused`` names saved values no trackable took, ``unrestored`` trackables the file did not
    have (nested ones as ``outer.inner``). Unless ``expect_partial()`` or an assertion was
    called, a status with either is reported by a warning when it is discarded, as in TF.
    """

    def __init__(
        self,
        save_path: str | None,
        unused: list[str] | None = None,
        unrestored: list[str] | None = None,
        matched: int = 0,
    ) -> None:
        self.save_path = save_path
        self.unused: tuple[str, ...] = tuple(unused or ())
        self.unrestored: tuple[str, ...] = tuple(unrestored or ())
        self.matched = matched
        self._checked = False

    def _nothing(self) -> CheckpointMatchError:
        return CheckpointMatchError(
            "no checkpoint was given (save_path=None); nothing was restored"
        )

    def assert_consumed(self) -> LoadStatus:
        """Raise unless every saved value was restored and every trackable was in the file."""
        self._checked = True
        if self.save_path is None:
            raise self._nothing()
        if self.unused or self.unrestored:
            raise CheckpointMatchError(
                f"checkpoint {self.save_path!r} and the trackables differ: saved values without "
                f"a trackable [{few(list(self.unused))}], trackables not in the checkpoint "
                f"[{few(list(self.unrestored))}]"
            )
        return self

    def assert_existing_objects_matched(self) -> LoadStatus:
        """Raise unless every trackable was in the file (extra saved values are allowed)."""
        self._checked = True
        if self.save_path is None:
            raise self._nothing()
        if self.unrestored:
            raise CheckpointMatchError(
                f"checkpoint {self.save_path!r} has no value for the trackables "
                f"[{few(list(self.unrestored))}]"
            )
        return self

    def assert_nontrivial_match(self) -> LoadStatus:
        """Raise unless at least one trackable was restored."""
        self._checked = True
        if self.save_path is None:
            raise self._nothing()
        if self.matched == 0:
            raise CheckpointMatchError(
                f"checkpoint {self.save_path!r} matched none of the trackables "
                f"(missing: [{few(list(self.unrestored))}])"
            )
        return self

    def expect_partial(self) -> LoadStatus:
        """Declare a partial match intended: no warning about unmatched values."""
        self._checked = True
        return self

    def __del__(self) -> None:
        if self._checked or not (self.unused or self.unrestored):
            return
        try:
            warnings.warn(
                f"restoring {self.save_path!r} left saved values unused "
                f"[{few(list(self.unused))}] and trackables unrestored "
                f"[{few(list(self.unrestored))}]; call expect_partial() on the status if "
                f"that is intended",
                stacklevel=2,
            )
        except Exception:  # interpreter shutdown: nowhere left to warn
            pass
