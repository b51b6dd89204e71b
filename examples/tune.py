"""The seed's hyperparameter tuning job (Vertex AI), ported: 20 trials of the digits MLP, 2 at once.

TensorFlow → stratagem, line by line: ``aiplatform.CustomJob.from_local_script`` →
``sg.jobs.CustomJob.from_local_script`` (no container or bucket: the trial runs here, through
the launcher); ``aiplatform.HyperparameterTuningJob`` → ``sg.tune.HyperparameterTuningJob``
(Bayesian search with Optuna's TPE, the study in SQLite, so running this again resumes it);
``hyperparameter_tuning as hpt`` → ``sg.tune.hyperparameter_tuning``. The trial script is
examples/tune_trial.py. The search space is the seed's.

    python examples/tune.py                         # the seed's search: 20 trials, 2 in parallel
    python examples/tune.py --max-trial-count 3 --epochs 1     # a quick look
"""

import argparse
import os

import numpy as np

import stratagem as sg
from stratagem.tune import hyperparameter_tuning as hpt

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--max-trial-count", type=int, default=20)
parser.add_argument("--parallel-trial-count", type=int, default=2)
parser.add_argument("--epochs", type=int, default=10, help="epochs of each trial")
parser.add_argument("--output-dir", default="tune_output", help="jobs and the study go here")
parser.add_argument("--seed", type=int, default=42, help="the search's seed")
args = parser.parse_args()

here = os.path.dirname(os.path.abspath(__file__))
trial_job = sg.jobs.CustomJob.from_local_script(
    display_name="my_search_trial_job",
    script_path=os.path.join(here, "tune_trial.py"),  # path to your training script
    args=["--epochs", str(args.epochs)],
    base_output_dir=args.output_dir,
)

hp_job = sg.tune.HyperparameterTuningJob(
    display_name="my_hp_search_job",
    custom_job=trial_job,
    metric_spec={"accuracy": "maximize"},
    parameter_spec={
        "learning_rate": hpt.DoubleParameterSpec(min=1e-3, max=10, scale="log"),
        "n_neurons": hpt.IntegerParameterSpec(min=1, max=300, scale="linear"),
        "n_hidden": hpt.IntegerParameterSpec(min=1, max=10, scale="linear"),
        "optimizer": hpt.CategoricalParameterSpec(["sgd", "adam"]),
    },
    max_trial_count=args.max_trial_count,
    parallel_trial_count=args.parallel_trial_count,
    seed=args.seed,
)
table = sg.tune.TrialTable("accuracy", "maximize", hp_job.parameter_spec)
hp_job.run(progress=table)


def get_final_metric(trial, metric_id):
    for metric in trial.final_measurement.metrics:
        if metric.metric_id == metric_id:
            return metric.value


trials = hp_job.trials
# A failed trial has no final measurement (None): it never wins.
trial_accuracies = [get_final_metric(trial, "accuracy") or -np.inf for trial in trials]
best_trial = trials[np.argmax(trial_accuracies)]

print(f"max(trial_accuracies) = {max(trial_accuracies)}")
print(f"best_trial.id = {best_trial.id!r}")
print(f"best_trial.parameters = {dict(best_trial.parameters)}")
print(f"best model: {best_trial.job_dir / 'model' / 'digits_mlp'}")
print(f"plot: {hp_job.plot()}")
