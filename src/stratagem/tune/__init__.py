"""Hyperparameter tuning studies with Vertex AI's names, run locally with Optuna.

``sg.tune.HyperparameterTuningJob(display_name, custom_job, metric_spec, parameter_spec,
max_trial_count, parallel_trial_count).run()``; the specs ``DoubleParameterSpec``,
``IntegerParameterSpec``, ``CategoricalParameterSpec``, ``DiscreteParameterSpec`` (in
``parameter_specs``, also as ``sg.tune.hyperparameter_tuning``, the seed's ``hpt``); in the trial
script, ``sg.tune.report_hyperparameter_tuning_metric(hyperparameter_metric_tag, metric_value,
global_step)``. The tuner (and Optuna) load on first use, so a trial script that only reports
imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

from stratagem.tune import parameter_specs
from stratagem.tune.parameter_specs import (
    CategoricalParameterSpec,
    DiscreteParameterSpec,
    DoubleParameterSpec,
    IntegerParameterSpec,
    ParameterSpecError,
)
from stratagem.tune.report import HyperTune, ReportError, report_hyperparameter_tuning_metric
from stratagem.tune.trials import Measurement, Trial, TrialMetric, TrialState

# ``sg.tune.Metric``, its public name since it was added; the class is ``TrialMetric`` so that
# it is not confused with ``sg.keras.metrics.Metric``.
Metric = TrialMetric

# The seed's spelling, ``from google.cloud.aiplatform import hyperparameter_tuning as hpt``,
# ported as ``from stratagem.tune import hyperparameter_tuning as hpt``: the module holding the
# specs is ``parameter_specs``, named for what it holds; this attribute is that module.
hyperparameter_tuning = parameter_specs

_LAZY = {
    "HyperparameterTuningJob": "stratagem.tune.tuning_job",
    "TuningConfigError": "stratagem.tune.errors",
    "TuningError": "stratagem.tune.errors",
    "TrialTable": "stratagem.tune.table",
}

__all__ = [
    "CategoricalParameterSpec",
    "DiscreteParameterSpec",
    "DoubleParameterSpec",
    "HyperTune",
    "HyperparameterTuningJob",
    "IntegerParameterSpec",
    "Measurement",
    "Metric",
    "ParameterSpecError",
    "ReportError",
    "Trial",
    "TrialMetric",
    "TrialState",
    "TrialTable",
    "TuningConfigError",
    "TuningError",
    "hyperparameter_tuning",
    "parameter_specs",
    "report_hyperparameter_tuning_metric",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stratagem.tune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
