"""The coordinator as TF specifies it (TF's ``cluster_coordinator_test.py``), in one real job
(1 chief, 2 workers, 1 ps: ``workers/coordinator_fidelity.py``) shared by the tests below, and
a dataset's recipe in one process."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, Process, child_env
from stratagem.data.options import Options


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    argv = [sys.executable, "-m", "stratagem.cli", "run", "--chief", "-n", "2", "--ps", "1"]
    argv += [str(WORKERS / "coordinator_fidelity.py"), str(out)]
    env = child_env({"STRATAGEM_CHECK_KEPT_DESCRIPTIONS": "1"})  # as the whole suite runs
    result = Process(argv, env, out, "launcher", merge_output=True).wait(timeout=300)
    assert result.returncode == 0, result.stdout
    assert "coordinator fidelity done" in result.stdout, result.stdout
    return json.loads((out / "result.json").read_text())


def _part(job, name):
    part = job[name]
    assert "error" not in part, f"{part['error']}\n{part['traceback']}"
    return part["value"]


@pytest.mark.multiprocess
def test_create_per_worker_dataset_takes_a_dataset_and_a_distributed_dataset(job):
    got = _part(job, "datasets")
    assert got["dataset"] == [1, 2, 3, 4]  # TF: range(1, 11).batch(4) passed as it is
    assert got["mapped"] == 10  # its map function travels by reference
    assert got["distributed"] == [1, 2, 3, 4]  # experimental_distribute_dataset on the chief
    assert got["from_function"] == [1, 2, 3, 4]  # distribute_datasets_from_function likewise
    # Each worker shuffles its own copy its own way (TF's testDatasetsShuffledDifferently).
    (w0, batch0), (w1, batch1) = got["shuffled"]
    assert [w0, w1] == [0, 1]
    assert sorted(batch0) == sorted(batch1) == list(range(100))
    assert batch0 != batch1


def _fit_loss(weights: dict) -> float:
    """The cross-entropy of the worker script's linear model on all of its fit data."""
    x = torch.linspace(-1, 1, 64).reshape(32, 2)
    y = (x.sum(dim=1) > 0).long()
    logits = x @ torch.tensor(weights["weight"]).T + torch.tensor(weights["bias"])
    return torch.nn.functional.cross_entropy(logits, y).item()


@pytest.mark.multiprocess
def test_coordinated_fit_takes_a_dataset_as_tfs_tutorial_passes_it(job):
    got = _part(job, "keras")
    torch.manual_seed(0)
    built = {k: v.tolist() for k, v in torch.nn.Linear(2, 2).state_dict().items()}
    for name in ("dataset", "creator"):
        fit = got[name]
        assert (fit["epochs"], fit["steps"]) == (2, 8), (name, fit)
        # Every step's gradient reached the ps and was applied there (async: one each).
        assert fit["applied"] == 8, (name, fit)
        # It trained from the chief's values on that data: the weights the chief reads from the
        # ps after fit fit it better than those it built. (The steps' order over the two workers
        # and the staleness of each are the scheduler's, so no one-process loop gives the exact
        # weights; 8 SGD steps of 0.1 on this separable data take the loss from 1.18 to ~0.81
        # in one process, in any order of the batches: a margin of 0.1 leaves room for stale
        # gradients and fails if the steps did not reach the ps.)
        assert fit["before"] == built, (name, fit)
        assert _fit_loss(fit["after"]) < _fit_loss(built) - 0.1, (name, fit)


@pytest.mark.multiprocess
def test_backup_and_restore_under_the_coordinator_resumes_at_the_next_epoch(job):
    """TF's parameter-server tutorial passes ``BackupAndRestore`` to ``fit``: interrupted after
    epoch 1's backup, the fit run again goes on from epoch 2 with the optimizer's 4 steps (2 a
    function, 2 an epoch), and deletes the backup at its end."""
    got = _part(job, "backup")
    assert got["interrupted"] == "interrupted", got
    assert got["epochs"] == [0, 1, 2, 3], got
    assert got["steps"] == [4, 8], got
    assert got["left"] == [], got


@pytest.mark.multiprocess
def test_iter_of_a_distributed_dataset_on_the_coordinator_is_a_value_error(job):
    got = _part(job, "iter")
    assert "you need to pass this dataset to ClusterCoordinator.create_per_worker_dataset" in (
        got["distributed"] or ""
    ), got
    assert "You need to use this dataset in ClusterCoordinator.create_per_worker_dataset" in (
        got["from_function"] or ""
    ), got


@pytest.mark.multiprocess
def test_an_int64_variable_made_in_scope_lives_on_the_ps(job):
    got = _part(job, "int64")
    # TF's testInputFunction: each function reads 1 and assign_adds it on the ps; the
    # coordinator reads 2.
    assert got["values"] == [1, 1] and got["chief_reads"] == 2, got
    assert got["dtype"] == "torch.int64" and got["in_scope"], got


@pytest.mark.multiprocess
def test_batchnorm_updates_from_one_read_both_add_and_a_later_call_reads_their_sum(job):
    """tf_keras's ``BatchNormalization._assign_moving_average`` moves each statistic with
    ``assign_sub((variable - value) * (1 - momentum))``, ``variable`` read on the ps: two
    workers that read the same values both add their change there (neither overwrites the
    other), and a later call on either worker starts from the ps's values, both changes in,
    not from its own copy (which BatchNorm's kernel moved without a version count). Batch
    [[1, 2], [3, 6]]: mean [2, 4], unbiased variance [2, 8]; momentum 0.1 from mean 0 and
    variance 1, twice from that read (mean [0.4, 0.8], variance [1.2, 2.4]), then once from
    those (each by hand: 0.4 + 0.1 * (2 - 0.4) = 0.56, and so on)."""
    got = _part(job, "batchnorm")
    first, second, signal, last = got["ran_on"]
    assert sorted([first, second]) == [0, 1] and signal == second and last == first, got
    # From the worker's own copy (mean [0.2, 0.4]) the last call would give [0.58, 1.16].
    assert got["mean"] == pytest.approx([0.56, 1.12]), got
    assert got["var"] == pytest.approx([1.28, 2.96]), got  # from its own: [1.29, 3.03]
    assert got["batches"] == 3, got


@pytest.mark.multiprocess
def test_a_function_reads_every_write_that_ended_before_it_was_scheduled(job):
    got = _part(job, "freshness")
    w0 = got["w0"]
    # After join: both workers read both steps (the first to step had the older copy).
    assert {me: value for me, (value, _) in got["after_join"].items()} == {
        "0": w0 - 2,
        "1": w0 - 2,
    }, got
    # Scheduled behind a running step: the copy that step's push brought back, no pull.
    steps, looks = got["queued"]["steps"], got["queued"]["looks"]
    assert sorted(value for value, _ in looks.values()) == [w0 - 4, w0 - 3], got
    assert {me: pulls for me, (_, pulls) in looks.items()} == {
        me: pulls for me, (pulls,) in steps.items()
    }, got
    # A copy changed on its worker (not pushed) is pulled again: the ps's value, not the change.
    steps, looks = got["changed"]["steps"], got["changed"]["looks"]
    assert [value for value, _ in looks.values()] == [w0 - 6, w0 - 6], got
    assert {me: pulls for me, (_, pulls) in looks.items()} == {
        me: pulls + 1 for me, (pulls,) in steps.items()
    }, got
    assert got["chief"] == w0 - 6, got


@pytest.mark.multiprocess
def test_a_worker_uses_a_kept_table_only_while_the_chiefs_is_the_same(job):
    got = _part(job, "tables")
    assert got["same"] == [[3, "int"]] * 6, got
    # Six calls on two workers: each had the table whole once at most, then by its number.
    assert got["by_number"] >= 4, got
    # 1, True and 1.0 are equal in Python, yet each is another table; a worker that keeps the
    # table before is sent only the entry that changed (the function's: its global), so all
    # four but a worker's first table (one that ran none of the six) went as changes.
    assert got["changed"] == [[3, "bool"], [3.0, "float"], [6, "int"], [3, "int"]], got
    assert got["as_changes"] >= 3, got
    # A captured tensor is sent each time: a worker's change of its copy never outlives a call.
    assert got["bumped"] == [2.0, 2.0, 2.0], got


@pytest.mark.multiprocess
def test_a_worker_calls_its_last_objects_again_only_while_no_call_changed_them(job):
    got = _part(job, "reuse")
    # Eight calls on two workers: one of them ran at least four, and from its third on (its
    # first table whole, the second by number and watched) it called the same objects.
    assert got["same_objects"][:2] == [False, False], got
    assert True in got["same_objects"], got
    # Each of these changes what it captured: the next call on its worker is built again and
    # sees what the chief holds, as every call does.
    assert got["grow"] == [[1, 1]] * 8, got
    assert got["decay"] == [0.25] * 8, got
    assert got["mark"] == [1] * 8, got
    assert got["hook"] == [1] * 8, got
    assert got["evaluate"] == [True] * 8, got
    assert got["rebind"] == [1] * 8, got
    assert got["make_counter.<locals>.counter"] == [1] * 8, got
    # Kept though the call changed them, since a rebuild sets them anew: a metric's totals
    # (it starts empty: the chief's sum counts each call once) and a volatile attribute (a
    # Keras optimizer's step counter: each call starts from the chief's).
    assert True in got["add_one"] and got["tally"] == 8.0, got
    # optimizer.iterations is TF's ps variable: each call's step comes back to the chief.
    assert [before for before, _ in got["count_on"]] == list(range(8)), got
    assert True in [again for _, again in got["count_on"]], got
    # Kept though the call added Python's registry of the warnings it showed to its globals.
    assert True in got["warn"], got


@pytest.mark.multiprocess
def test_a_failure_cancels_the_functions_still_running_and_join_is_clean_after(job):
    got = _part(job, "cancel")
    assert "the failure that cancels the rest" in (got["join"] or ""), got
    assert "the failure that cancels the rest" in (got["failed"] or ""), got
    # In flight when the other failed: cancelled, and stopped on its worker at its next read.
    assert "was cancelled while it ran" in (got["running"] or ""), got
    assert got["stopped_by"] == "CancelledError", got
    assert got["done"] and got["after"] == [0, 2, 4], got


def test_a_dataset_is_made_again_from_its_recipe():
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    made = (
        sg.data.Dataset.from_tensor_slices((x, y))
        .shuffle(6, seed=3)
        .repeat(2)
        .map(lambda a, b: (a * 2, b))
        .batch(4)
        .prefetch(2)
    )
    again = sg.data.Dataset.from_recipe(made.recipe())
    for a, b in zip(made, again, strict=True):
        torch.testing.assert_close(a, b)
    assert [m for m, _ in made.recipe()] == [
        "from_tensor_slices", "shuffle", "repeat", "map", "batch", "prefetch",
    ]  # fmt: skip
    # Made otherwise than by its methods: no recipe, and a worker could not make it again.
    assert made.reseeded(1).recipe() is None
    with pytest.raises(sg.errors.InputError, match=r"names '__init__', which is not one of"):
        sg.data.Dataset.from_recipe([["range", [3]], ["__init__", []]])
    with pytest.raises(sg.errors.InputError, match="is not one of"):
        sg.data.Dataset.from_recipe([["shuffle", [3]]])
    assert sg.data.Dataset.range(3).with_options(Options()).recipe()[-1][0] == "with_options"


@pytest.mark.multiprocess
def test_the_chief_describes_a_function_once_yet_each_call_sees_what_the_chief_changed(job):
    got = _part(job, "chief_changes")
    assert got["again"] == [0] * 4, got
    assert got["kept"] >= 3, got  # the same function and arguments, nothing changed between
    # Before each pair of schedules the chief changed what the function reads; both calls of
    # the pair see it (the second one's description is the first's, kept, and must be fresh).
    rounds = [1, 2, 3, 4]
    for name in ("setting", "table", "option", "level", "args", "kwargs", "iterations"):
        assert got[name] == [[k, k] for k in [0, *rounds]], (name, got[name])
    assert got["note"] == [[None, None]] + [[k, k] for k in rounds], got["note"]
    assert got["items"] == [[list(range(k + 1))] * 2 for k in [0, *rounds]], got["items"]
    assert got["training"] == [[True] * 2] + [[k % 2 == 0] * 2 for k in rounds], got["training"]
    assert got["lr"] == [[0.5] * 2] + [[k / 4] * 2 for k in rounds], got["lr"]
    assert got["trainable"] == [[True] * 2] + [[k % 2 == 0] * 2 for k in rounds], got
    assert got["hooks"] == [[k, k] for k in [0, *rounds]], got["hooks"]


@pytest.mark.multiprocess
def test_the_suites_check_of_kept_descriptions_catches_a_stale_one(job):
    got = _part(job, "stale_check")
    assert "kept the last description, but a new one differs" in (got or ""), got
    assert "table entry" in got and "'v': 0" in got and "'v': 1" in got, got


@pytest.mark.multiprocess
def test_a_remote_value_argument_is_its_value_or_its_functions_error(job):
    """TF's ``maybe_get_remote_value``: a RemoteValue passed to ``schedule`` reaches the
    function as its value; where its function failed, the function does not run and fails
    with ``ClosureInputError`` naming the original failure."""
    got = _part(job, "remote_inputs")
    assert got["second"] == 12.0  # double(double(3))
    assert got["both"] == 6.0 + 12.0 + 6.0
    assert "the input's own failure" in (got["failed"] or ""), got
    for raised_by in ("join", "fetch"):
        message = got[raised_by] or ""
        assert message.startswith("ClosureInputError: Input has an error"), got
        assert "the input's own failure" in message, got
    assert got["after"] == 24.0  # the coordinator goes on


@pytest.mark.multiprocess
def test_a_custom_loops_optimizer_steps_count_in_the_chiefs_iterations(job):
    """TF's ``optimizer.iterations`` is a ps variable: 6 steps scheduled on 2 workers make the
    chief's count 6 after ``join``."""
    assert _part(job, "loop_iterations") == 6
