"""The search algorithm of a study: Optuna's samplers, named as Vertex AI names them.

``search_algorithm=None`` is Vertex AI's default, Bayesian optimization: here Optuna's TPE,
seeded, multivariate (it models the parameters jointly, which finds interactions such as
learning rate x optimizer), with a few random start-up trials scaled to the budget; with
parallel trials, the "constant liar" keeps trials started together from sampling the same
point. ``"random"`` is random search, the baseline of ``benchmarks/tuning_search.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.errors import StratagemError

if TYPE_CHECKING:
    from optuna.samplers import BaseSampler

SEARCH_ALGORITHMS = (None, "random")


class SearchAlgorithmError(StratagemError, ValueError):
    """An unknown search algorithm."""


def check_search_algorithm(search_algorithm: object) -> str | None:
    if search_algorithm not in SEARCH_ALGORITHMS:
        raise SearchAlgorithmError(
            f"unknown search_algorithm {search_algorithm!r}; expected None (Bayesian "
            f"optimization) or 'random' ('grid' is not supported)"
        )
    return search_algorithm  # type: ignore[return-value]


def startup_trials(max_trial_count: int) -> int:
    """Random trials before the model takes over: 40 % of the budget, 3 to 10 (8 of 20).

    The choice is measured in ``docs/benchmarks.md`` ("Hyperparameter search").
    """
    return min(10, max(3, round(0.4 * max_trial_count)))


def make_sampler(
    search_algorithm: str | None, seed: int | None, max_trial_count: int
) -> BaseSampler:
    import optuna

    check_search_algorithm(search_algorithm)
    if search_algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(
        seed=seed,
        n_startup_trials=startup_trials(max_trial_count),
        multivariate=True,
        constant_liar=True,
    )
