"""The search space: Vertex AI's parameter specs, and their translation to Optuna distributions.

Ported as ``from stratagem.tune import hyperparameter_tuning as hpt`` (the seed writes
``from google.cloud.aiplatform import hyperparameter_tuning as hpt``): ``hyperparameter_tuning``
is this module under the seed's name, an alias in ``tune/__init__.py``. Each spec checks its
arguments when made, so a bad space fails before any trial runs. Optuna is imported only by
``distribution()``, so that a trial script that imports the specs starts fast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stratagem.errors import StratagemError

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

SCALES = ("linear", "log")


class ParameterSpecError(StratagemError, ValueError):
    """A parameter spec is invalid: the message echoes it and says what was expected."""


def _number(spec: str, name: str, value: object, kind: type) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()  # type: ignore[arg-type]
    if not ok or not math.isfinite(value):  # type: ignore[arg-type]
        expected = "an int" if kind is int else "a finite number"
        raise ParameterSpecError(f"{spec}: {name} must be {expected}, got {value!r}")
    return kind(value)


def _check_range(spec: str, low: float, high: float, scale: str) -> None:
    if scale not in SCALES:
        raise ParameterSpecError(
            f"{spec}: unknown scale {scale!r}; expected one of {', '.join(map(repr, SCALES))}"
        )
    if low > high:
        raise ParameterSpecError(f"{spec}: min must be <= max")
    if scale == "log" and low <= 0:
        raise ParameterSpecError(f"{spec}: a log scale needs min > 0")


@dataclass(frozen=True)
class DoubleParameterSpec:
    """A real number in ``[min, max]``, searched uniformly on a linear or log scale."""

    min: float
    max: float
    scale: str = "linear"

    def __post_init__(self) -> None:
        name = f"DoubleParameterSpec(min={self.min!r}, max={self.max!r}, scale={self.scale!r})"
        object.__setattr__(self, "min", _number(name, "min", self.min, float))
        object.__setattr__(self, "max", _number(name, "max", self.max, float))
        _check_range(name, self.min, self.max, self.scale)

    def distribution(self) -> BaseDistribution:
        from optuna.distributions import FloatDistribution

        return FloatDistribution(self.min, self.max, log=self.scale == "log")


@dataclass(frozen=True)
class IntegerParameterSpec:
    """An integer in ``[min, max]``, on a linear or log scale."""

    min: int
    max: int
    scale: str = "linear"

    def __post_init__(self) -> None:
        name = f"IntegerParameterSpec(min={self.min!r}, max={self.max!r}, scale={self.scale!r})"
        object.__setattr__(self, "min", _number(name, "min", self.min, int))
        object.__setattr__(self, "max", _number(name, "max", self.max, int))
        _check_range(name, self.min, self.max, self.scale)

    def distribution(self) -> BaseDistribution:
        from optuna.distributions import IntDistribution

        return IntDistribution(self.min, self.max, log=self.scale == "log")


def _values(spec: str, values: object, allowed: tuple[type, ...]) -> tuple[Any, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ParameterSpecError(f"{spec}: values must be a list, got {values!r}")
    if not values:
        raise ParameterSpecError(f"{spec}: values must not be empty")
    bad = [v for v in values if not isinstance(v, allowed) or isinstance(v, bool)]
    if bad:
        kinds = " or ".join(t.__name__ for t in allowed)
        raise ParameterSpecError(f"{spec}: values must be {kinds}, got {bad!r}")
    if len(set(values)) != len(values):
        raise ParameterSpecError(f"{spec}: values must be distinct")
    return tuple(values)


@dataclass(frozen=True)
class CategoricalParameterSpec:
    """One of the given strings (no order between them)."""

    values: Sequence[str]

    def __post_init__(self) -> None:
        spec = f"CategoricalParameterSpec(values={self.values!r})"
        object.__setattr__(self, "values", _values(spec, self.values, (str,)))

    def distribution(self) -> BaseDistribution:
        from optuna.distributions import CategoricalDistribution

        return CategoricalDistribution(self.values)


@dataclass(frozen=True)
class DiscreteParameterSpec:
    """One of the given numbers (``scale`` is kept for Vertex AI's signature)."""

    values: Sequence[float]
    scale: str = "linear"

    def __post_init__(self) -> None:
        spec = f"DiscreteParameterSpec(values={self.values!r}, scale={self.scale!r})"
        values = _values(spec, self.values, (int, float))
        if not all(math.isfinite(v) for v in values):
            raise ParameterSpecError(f"{spec}: values must be finite")
        if self.scale not in SCALES:
            raise ParameterSpecError(
                f"{spec}: unknown scale {self.scale!r}; expected one of "
                f"{', '.join(map(repr, SCALES))}"
            )
        object.__setattr__(self, "values", tuple(sorted(values)))

    def distribution(self) -> BaseDistribution:
        from optuna.distributions import CategoricalDistribution

        return CategoricalDistribution(self.values)


ParameterSpec = (
    DoubleParameterSpec | IntegerParameterSpec | CategoricalParameterSpec | DiscreteParameterSpec
)
_SPECS = {
    "double": DoubleParameterSpec,
    "integer": IntegerParameterSpec,
    "categorical": CategoricalParameterSpec,
    "discrete": DiscreteParameterSpec,
}


def check_parameter_spec(parameter_spec: object) -> dict[str, ParameterSpec]:
    """``parameter_spec`` as a dict of name -> spec, or ``ParameterSpecError`` saying why not."""
    if not isinstance(parameter_spec, Mapping) or not parameter_spec:
        raise ParameterSpecError(
            f"parameter_spec must be a non-empty dict of name -> parameter spec, "
            f"got {parameter_spec!r}"
        )
    for name, spec in parameter_spec.items():
        if not isinstance(name, str) or not name or name.startswith("-") or " " in name:
            raise ParameterSpecError(
                f"parameter names must be option names such as 'learning_rate', got {name!r}"
            )
        if not isinstance(spec, tuple(_SPECS.values())):
            raise ParameterSpecError(
                f"parameter {name!r}: expected DoubleParameterSpec, IntegerParameterSpec, "
                f"CategoricalParameterSpec or DiscreteParameterSpec, got {spec!r}"
            )
    return dict(parameter_spec)


def distributions(parameter_spec: Mapping[str, ParameterSpec]) -> dict[str, BaseDistribution]:
    """The Optuna search space of ``parameter_spec``: what the tuner and the benchmark search."""
    return {
        name: spec.distribution() for name, spec in check_parameter_spec(parameter_spec).items()
    }


def spec_to_json(spec: ParameterSpec) -> dict[str, Any]:
    """``{"type": "double", "min": ..., ...}``: the spec file's form, stored with the study."""
    kind = next(k for k, cls in _SPECS.items() if isinstance(spec, cls))
    fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(spec).items()}
    return {"type": kind, **fields}


def spec_from_json(name: str, data: object) -> ParameterSpec:
    """The spec of ``spec_to_json``'s form; errors name the parameter and the types known."""
    if not isinstance(data, Mapping) or data.get("type") not in _SPECS:
        raise ParameterSpecError(
            f'parameter {name!r}: expected an object with "type" one of {list(_SPECS)}, '
            f"got {data!r}"
        )
    fields = {k: v for k, v in data.items() if k != "type"}
    try:
        return _SPECS[data["type"]](**fields)
    except TypeError as exc:  # an unknown or missing field
        raise ParameterSpecError(f"parameter {name!r}: {exc}") from None


def format_value(value: object) -> str:
    """A parameter value as a command-line argument: ``0.001``, ``8``, ``adam``."""
    if isinstance(value, float):
        return repr(value)
    return str(value)
