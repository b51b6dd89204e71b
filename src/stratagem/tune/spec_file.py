"""The study file ``stratagem tune`` runs: a HyperparameterTuningJob's arguments as JSON.

    {"display_name": "digits_search",
     "custom_job": {"script_path": "trial.py", "args": ["--epochs", "3"], "replica_count": 1},
     "metric_spec": {"accuracy": "maximize"},
     "parameter_spec": {
       "learning_rate": {"type": "double", "min": 0.001, "max": 10, "scale": "log"},
       "n_hidden": {"type": "integer", "min": 1, "max": 10},
       "optimizer": {"type": "categorical", "values": ["sgd", "adam"]}},
     "max_trial_count": 20, "parallel_trial_count": 2}

Relative paths (``script_path``, ``base_output_dir``) are relative to the file's folder; the
optional keys are the job's other arguments (``seed``, ``search_algorithm``...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError
from stratagem.jobs import CustomJob
from stratagem.tune.parameter_specs import spec_from_json
from stratagem.tune.tuning_job import HyperparameterTuningJob

REQUIRED = ("display_name", "custom_job", "metric_spec", "parameter_spec", "max_trial_count")
OPTIONAL = (
    "parallel_trial_count",
    "max_failed_trial_count",
    "search_algorithm",
    "measurement_selection",
    "base_output_dir",
    "seed",
    "median_stopping",
    "median_stopping_min_trials",
    "median_stopping_warmup_steps",
    "devices_per_trial",
)
JOB_KEYS = (
    "script_path",
    "args",
    "replica_count",
    "ps_replica_count",
    "environment_variables",
    "accelerator_type",
    "accelerator_count",
)


class SpecFileError(StratagemError, ValueError):
    """A study file cannot be read or says something invalid."""


def _keys(where: str, data: object, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    if not isinstance(data, dict):
        raise SpecFileError(f"{where}: expected a JSON object, got {data!r}")
    missing = [k for k in required if k not in data]
    unknown = sorted(set(data) - set(required) - set(optional))
    if missing:
        raise SpecFileError(f"{where}: missing {missing}")
    if unknown:
        raise SpecFileError(
            f"{where}: unknown keys {unknown}; expected {list(required) + list(optional)}"
        )
    return data


def load_tuning_job(
    path: str | os.PathLike[str], base_output_dir: str | os.PathLike[str] | None = None
) -> HyperparameterTuningJob:
    """The tuning job a study file describes (``base_output_dir`` overrides the file's)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecFileError(f"study file {str(path)!r} not found") from None
    except json.JSONDecodeError as exc:
        raise SpecFileError(f"study file {str(path)!r} is not valid JSON: {exc}") from None
    data = _keys(str(path), data, REQUIRED, OPTIONAL)
    job_data = _keys(f"{path}: custom_job", data["custom_job"], ("script_path",), JOB_KEYS[1:])
    here = path.resolve().parent
    if base_output_dir is None and data.get("base_output_dir") is not None:
        base_output_dir = here / data["base_output_dir"]
    base = Path(base_output_dir) if base_output_dir is not None else here / "stratagem_jobs"
    job_kwargs: dict[str, Any] = {k: v for k, v in job_data.items() if k != "script_path"}
    custom_job = CustomJob(
        f"{data['display_name']}_trial",
        here / job_data["script_path"],
        base_output_dir=base,
        **job_kwargs,
    )
    if not isinstance(data["parameter_spec"], dict):
        raise SpecFileError(
            f"{path}: parameter_spec must be an object, got {data['parameter_spec']!r}"
        )
    parameter_spec = {
        name: spec_from_json(name, spec) for name, spec in data["parameter_spec"].items()
    }
    options = {k: data[k] for k in OPTIONAL if k in data and k != "base_output_dir"}
    return HyperparameterTuningJob(
        data["display_name"],
        custom_job,
        metric_spec=data["metric_spec"],
        parameter_spec=parameter_spec,
        max_trial_count=data["max_trial_count"],
        parallel_trial_count=options.pop("parallel_trial_count", 1),
        base_output_dir=base,
        **options,
    )
