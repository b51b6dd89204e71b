"""Bayesian search (the tuner's TPE) against random search on a known synthetic objective.

Both searches run in this process on the seed's search space, translated to Optuna exactly as
``HyperparameterTuningJob`` translates it (``parameter_specs.distributions``) and sampled
by the same ``make_sampler``: no trial subprocesses, so it takes seconds. For each seed, each
search gets ``--trials`` trials (ask/tell, as the tuner does); the better best-of-N wins.
Target (issue 7): Bayesian wins in at least 7 of 10 seeds.

    .venv/bin/python benchmarks/tuning_search.py [--seeds 10] [--trials 20]
"""

from __future__ import annotations

import argparse
import math

import optuna

from stratagem.tune import hyperparameter_tuning as hpt
from stratagem.tune.search import make_sampler

RANDOM_SEED_OFFSET = 1000

# The seed's search space (Hands-On ML ch. 19, the Vertex AI tuning job).
PARAMETER_SPEC = {
    "learning_rate": hpt.DoubleParameterSpec(min=1e-3, max=10, scale="log"),
    "n_neurons": hpt.IntegerParameterSpec(min=1, max=300, scale="linear"),
    "n_hidden": hpt.IntegerParameterSpec(min=1, max=10, scale="linear"),
    "optimizer": hpt.CategoricalParameterSpec(["sgd", "adam"]),
}


def synthetic_accuracy(p: dict) -> float:
    """A smooth 'accuracy' in (0, 1]: best at lr 0.03, 180 neurons, 4 layers, adam.

    Shaped like a validation accuracy surface: a log-scale bump in the learning rate, broad
    optima in the sizes, a penalty for the worse optimizer. Its maximum is 1.0.
    """
    lr_term = math.exp(-((math.log10(p["learning_rate"]) - math.log10(0.03)) ** 2) / 0.5)
    neurons_term = math.exp(-(((p["n_neurons"] - 180) / 120) ** 2))
    hidden_term = math.exp(-(((p["n_hidden"] - 4) / 4) ** 2))
    optimizer_term = 1.0 if p["optimizer"] == "adam" else 0.8
    return lr_term * neurons_term * hidden_term * optimizer_term


def best_of(search_algorithm: str | None, seed: int, trials: int) -> float:
    study = optuna.create_study(
        direction="maximize", sampler=make_sampler(search_algorithm, seed, trials)
    )
    space = hpt.distributions(PARAMETER_SPEC)
    for _ in range(trials):
        trial = study.ask(space)
        study.tell(trial, synthetic_accuracy(trial.params))
    return study.best_value


def compare(seeds: int, trials: int) -> list[tuple[int, float, float]]:
    """(seed, Bayesian best, random best) for seeds 0..seeds-1."""
    return [
        # Independent streams: the same seed would give both the same first random trials.
        (seed, best_of(None, seed, trials), best_of("random", RANDOM_SEED_OFFSET + seed, trials))
        for seed in range(seeds)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = compare(args.seeds, args.trials)
    print(f"best-of-{args.trials} synthetic accuracy (max 1.0)")
    print("seed  bayesian  random  winner")
    for seed, bayes, rand in rows:
        print(f"{seed:4d}  {bayes:8.4f}  {rand:6.4f}  {'bayesian' if bayes > rand else 'random'}")
    wins = sum(bayes > rand for _, bayes, rand in rows)
    print(f"Bayesian (TPE) better in {wins} of {len(rows)} seeds")


if __name__ == "__main__":
    main()
