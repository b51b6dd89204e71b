"""``sg.tune``: parameter specs, reports, and real studies of a tiny trial script.

The trial script (``workers/tune_trial.py``) reports a known function of its ``--options``, so
each trial's recorded value can be checked against its parameters. Studies run in ``tmp_path``
with a fixed seed; processes synchronise through files and the study database, with timeouts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import optuna
import pytest

import stratagem as sg
from cluster_utils import REPO, WORKERS, Process, child_env
from stratagem import cli
from stratagem.cluster import launcher
from stratagem.tune import TuningError
from stratagem.tune import hyperparameter_tuning as hpt
from stratagem.tune.report import METRIC_FILE_VARIABLE, ReportReader
from stratagem.tune.spec_file import load_tuning_job

SCRIPT = WORKERS / "tune_trial.py"
SPACE = {
    "x": hpt.DoubleParameterSpec(min=0, max=1),
    "y": hpt.IntegerParameterSpec(min=1, max=8),
    "kind": hpt.CategoricalParameterSpec(["a", "b"]),
}
TIMEOUT_S = 120


def make_job(tmp_path, name, args=(), replica_count=1, space=SPACE, **kwargs):
    custom_job = sg.jobs.CustomJob(
        f"{name}_trial", SCRIPT, args=list(args), replica_count=replica_count,
        base_output_dir=tmp_path,
    )  # fmt: skip
    options = {"max_trial_count": 4, "parallel_trial_count": 2, "seed": 0, **kwargs}
    return sg.tune.HyperparameterTuningJob(
        name, custom_job, metric_spec={"accuracy": "maximize"}, parameter_spec=space, **options
    )


def expected_score(p):
    """The trial script's objective (its final report)."""
    return 1 - (p["x"] - 0.3) ** 2 - (p["y"] - 4) ** 2 / 100 - (0.2 if p["kind"] == "b" else 0)


def get_final_metric(trial, metric_id):  # the seed's function, verbatim
    for metric in trial.final_measurement.metrics:
        if metric.metric_id == metric_id:
            return metric.value


# --- the search space and the reports (no processes) --------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: hpt.DoubleParameterSpec(min=1e-3, max=10, scale="reverse_log"),
            "DoubleParameterSpec(min=0.001, max=10, scale='reverse_log'): unknown scale "
            "'reverse_log'; expected one of 'linear', 'log'",
        ),
        (
            lambda: hpt.DoubleParameterSpec(min=2.0, max=1.0),
            "DoubleParameterSpec(min=2.0, max=1.0, scale='linear'): min must be <= max",
        ),
        (
            lambda: hpt.IntegerParameterSpec(min=5, max=1),
            "IntegerParameterSpec(min=5, max=1, scale='linear'): min must be <= max",
        ),
        (lambda: hpt.DoubleParameterSpec(min=0, max=1, scale="log"), "a log scale needs min > 0"),
        (lambda: hpt.IntegerParameterSpec(min=1.5, max=3), "min must be an int, got 1.5"),
        (lambda: hpt.DoubleParameterSpec(min="a", max=3), "min must be a finite number, got 'a'"),
        (
            lambda: hpt.CategoricalParameterSpec([]),
            "CategoricalParameterSpec(values=[]): values must not be empty",
        ),
        (lambda: hpt.CategoricalParameterSpec("sgd"), "values must be a list, got 'sgd'"),
        (lambda: hpt.CategoricalParameterSpec(["a", "a"]), "values must be distinct"),
        (lambda: hpt.DiscreteParameterSpec([]), "values must not be empty"),
        (lambda: hpt.DiscreteParameterSpec(["x"]), "values must be int or float, got ['x']"),
    ],
)
def test_bad_parameter_specs(make, message):
    with pytest.raises(sg.tune.ParameterSpecError) as info:
        make()
    assert message in str(info.value)


def test_specs_translate_to_optuna_distributions():
    space = hpt.distributions(
        {
            "learning_rate": hpt.DoubleParameterSpec(min=1e-3, max=10, scale="log"),
            "n_neurons": hpt.IntegerParameterSpec(min=1, max=300, scale="linear"),
            "optimizer": hpt.CategoricalParameterSpec(["sgd", "adam"]),
            "batch": hpt.DiscreteParameterSpec([64, 16, 32]),
        }
    )
    assert space["learning_rate"] == optuna.distributions.FloatDistribution(1e-3, 10, log=True)
    assert space["n_neurons"] == optuna.distributions.IntDistribution(1, 300)
    assert space["optimizer"] == optuna.distributions.CategoricalDistribution(("sgd", "adam"))
    assert space["batch"] == optuna.distributions.CategoricalDistribution((16, 32, 64))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metric_spec": {"accuracy": "max"}}, "unknown goal 'max' for 'accuracy'"),
        ({"metric_spec": {"a": "maximize", "b": "minimize"}}, "metric_spec must name one metric"),
        ({"parameter_spec": {}}, "parameter_spec must be a non-empty dict"),
        ({"parameter_spec": {"x": (0, 1)}}, "parameter 'x': expected DoubleParameterSpec"),
        ({"search_algorithm": "grid"}, "unknown search_algorithm 'grid'"),
        ({"parallel_trial_count": 0}, "parallel_trial_count must be an int >= 1, got 0"),
        ({"max_trial_count": -1}, "max_trial_count must be an int >= 1, got -1"),
        ({"measurement_selection": "first"}, "unknown measurement_selection 'first'"),
        ({"custom_job": "trial.py"}, "custom_job must be a sg.jobs.CustomJob"),
    ],
)
def test_bad_tuning_job_arguments(tmp_path, kwargs, message):
    arguments = {
        "display_name": "s",
        "custom_job": sg.jobs.CustomJob("t", SCRIPT, base_output_dir=tmp_path),
        "metric_spec": {"accuracy": "maximize"},
        "parameter_spec": SPACE,
        "max_trial_count": 2,
        "parallel_trial_count": 1,
        **kwargs,
    }
    with pytest.raises(ValueError) as info:
        sg.tune.HyperparameterTuningJob(**arguments)
    assert message in str(info.value)


def test_report_writes_the_metric_file_from_the_chief_only(tmp_path, monkeypatch, capsys):
    path = tmp_path / "metrics.jsonl"
    reader = ReportReader(path)
    sg.tune.report_hyperparameter_tuning_metric("accuracy", 0.5)  # not in a trial: printed
    assert "accuracy=0.5 at step None is not recorded" in capsys.readouterr().err
    monkeypatch.setenv(METRIC_FILE_VARIABLE, str(path))
    sg.tune.report_hyperparameter_tuning_metric(
        hyperparameter_metric_tag="accuracy", metric_value=np.float32(0.25), global_step=np.int64(7)
    )
    sg.tune.HyperTune().report_hyperparameter_tuning_metric("loss", 2.0)
    cluster = {"chief": ["h:1"], "worker": ["h:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker"}}))
    sg.tune.report_hyperparameter_tuning_metric("accuracy", 0.9, 8)  # a worker: not recorded
    reports = reader.read_new()
    assert [(r.tag, r.value, r.global_step) for r in reports] == [
        ("accuracy", 0.25, 7),
        ("loss", 2.0, None),
    ]
    with open(path, "a") as f:
        f.write('{"tag": "accuracy", "val')  # half a line: left for the next read
    assert reader.read_new() == []
    for bad, message in [
        (("", 1.0), "hyperparameter_metric_tag must be a non-empty string"),
        (("a", "high"), "metric_value must be a number, got 'high'"),
        (("a", 1.0, -1), "global_step must be >= 0, got -1"),
    ]:
        with pytest.raises(sg.tune.ReportError, match=message):
            sg.tune.report_hyperparameter_tuning_metric(*bad)


def test_bayesian_search_beats_random_search_in_at_least_7_of_10_seeds():
    # The benchmark's comparison, in this process: seeded, no timing, so the count is exact.
    path = REPO / "benchmarks" / "tuning_search.py"
    spec = importlib.util.spec_from_file_location("tuning_search", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    rows = benchmark.compare(seeds=10, trials=20)
    assert len(rows) == 10
    for _, bayes, rand in rows:
        assert 0 < bayes <= 1 and 0 < rand <= 1
    wins = sum(bayes > rand for _, bayes, rand in rows)
    assert wins >= 7, rows


# --- real studies ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def multiworker_study(tmp_path_factory):
    """4 trials of 2 tasks (chief + worker), 2 in parallel, 2 reports each.

    Not timed: how long a study takes depends on the machine's load, so it is no verdict;
    pytest's timeout is the net for a study that never ends."""
    tmp_path = tmp_path_factory.mktemp("multiworker")
    job = make_job(tmp_path, "mw", args=["--steps", "2"], replica_count=2, median_stopping=False)
    job.run()
    return job


@pytest.mark.e2e
def test_study_of_multiworker_trials(multiworker_study):
    job = multiworker_study
    assert str(job.state) == "JOB_STATE_SUCCEEDED"
    trials = job.trials
    # Optuna's numbers, as optuna-dashboard shows them; each trial's folder has its number.
    assert [t.id for t in trials] == ["0", "1", "2", "3"]
    assert [t.job_dir.name for t in trials] == ["0", "1", "2", "3"]
    assert len({tuple(t.parameters.values()) for t in trials}) == 4
    cpus = launcher.usable_cpus()
    assert job.threads_per_task() == max(1, cpus // (2 * 2))
    for trial in trials:
        assert str(trial.state) == "SUCCEEDED"
        # Each task got the trial's values as --name value, and its share of the CPUs.
        for task in ("chief-0", "worker-0"):
            seen = json.loads((trial.job_dir / f"seen-{task}").read_text())
            assert seen["x"] == trial.parameters["x"]
            assert seen["y"] == trial.parameters["y"]
            assert seen["kind"] == trial.parameters["kind"]
            assert seen["omp"] == str(job.threads_per_task())
            assert seen["model_dir"] == str(trial.job_dir / "model")
        # Only the chief reports: 2 reports, not 4.
        assert len((trial.job_dir / "metrics.jsonl").read_text().splitlines()) == 2
        assert [m.step_count for m in trial.measurements] == [0, 1]
        assert get_final_metric(trial, "accuracy") == pytest.approx(
            expected_score(trial.parameters)
        )
    # The seed's code for the best trial.
    trial_accuracies = [get_final_metric(trial, "accuracy") for trial in trials]
    best_trial = trials[np.argmax(trial_accuracies)]
    assert best_trial == job.best_trial
    summary = json.loads((job.study_dir / "study.json").read_text())
    assert summary["best_trial"] == best_trial.id
    assert summary["state"] == "JOB_STATE_SUCCEEDED"


@pytest.mark.e2e
def test_study_plot_is_a_readable_png(multiworker_study, tmp_path):
    import matplotlib.image

    job = multiworker_study
    path = job.plot(tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 200
    assert image.std() > 0  # something was drawn


@pytest.mark.e2e
def test_crashing_trials_are_recorded_failed_and_the_study_goes_on(tmp_path):
    job = make_job(tmp_path, "crash", args=["--mode", "crash"], max_trial_count=6)
    job.run()
    trials = job.trials
    assert len(trials) == 6
    states = {str(t.state) for t in trials}
    assert states == {"SUCCEEDED", "FAILED"}, [(t.parameters, t.state) for t in trials]
    for trial in trials:
        crashed = trial.parameters["x"] > 0.5
        assert (str(trial.state) == "FAILED") == crashed
        if crashed:
            assert trial.error.startswith("chief failed: exit code 3")
            log = trial.job_dir / "logs" / "chief.log"
            assert str(log) in trial.error
            assert "crashing on purpose" in log.read_text()
            assert trial.final_measurement.metrics == ()
            assert get_final_metric(trial, "accuracy") is None
    # Optuna's own API (what optuna-dashboard reads) sees the failed trials as failed.
    stored = optuna.load_study(study_name="crash", storage=job.storage_url).get_trials()
    failed = [t.state == optuna.trial.TrialState.FAIL for t in stored]
    assert failed == [str(t.state) == "FAILED" for t in trials]


@pytest.mark.e2e
def test_max_failed_trial_count_stops_the_study(tmp_path):
    args = ["--mode", "crash", "--crash_above", "-1"]  # every trial crashes
    job = make_job(tmp_path, "failing", args=args, parallel_trial_count=1, max_failed_trial_count=2)
    with pytest.raises(TuningError, match=r"2 trials failed \(max_failed_trial_count=2\)"):
        job.run()
    assert [str(t.state) for t in job.trials] == ["FAILED", "FAILED"]


@pytest.mark.e2e
def test_median_rule_stops_bad_trials(tmp_path):
    job = make_job(
        tmp_path,
        "prune",
        args=["--mode", "prune", "--steps", "3"],
        max_trial_count=5,
        parallel_trial_count=1,
        median_stopping_min_trials=3,
    )
    job.run()
    # Only the median rule ends a bad trial in time: left alone, it gives up after its 60 s
    # wait and exits 4 (FAILED, "gave up waiting"). So STOPPED, at step 0, proves the rule
    # stopped it before then, on any load (a stopwatch on the study would not).
    states = [str(t.state) for t in job.trials]
    assert states == ["SUCCEEDED"] * 3 + ["STOPPED"] * 2
    for trial in job.trials[3:]:
        assert trial.error.startswith("stopped by the median rule at step 0: accuracy=0.0333")
        assert [m.step_count for m in trial.measurements] == [0]
        state = json.loads((trial.job_dir / "job.json").read_text())
        assert state["state"] == "JOB_STATE_CANCELLED"
    # The dashboards read the study as it is. optuna-dashboard: Optuna's own API sees every trial
    # with its parameters, intermediate values and state.
    study = optuna.load_study(study_name="prune", storage=job.storage_url)
    assert study.metric_names == ["accuracy"]  # the dashboard's name for the objective
    stored = study.get_trials()
    complete, pruned = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED
    assert [t.state for t in stored] == [complete] * 3 + [pruned] * 2
    for frozen, trial in zip(stored, job.trials):
        assert frozen.params == dict(trial.parameters)
        expected = {0: 0.3, 1: 0.6, 2: 0.9} if frozen.state == complete else {0: 0.1 / 3}
        assert frozen.intermediate_values == pytest.approx(expected)
        # TensorBoard's HParams plugin: each trial's parameters and objective beside its scalars.
        _check_hparams_events(job, trial, frozen)
    # TensorBoard's runs are the trials by the same number: trial-0 .. trial-4.
    runs = sorted(p.name for p in (job.study_dir / "tensorboard").iterdir())
    assert runs == [f"trial-{n}" for n in range(5)]


def _check_hparams_events(job, trial, frozen):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run = job.study_dir / "tensorboard" / f"trial-{trial.id}"
    assert json.loads((trial.job_dir / "job.json").read_text())["tensorboard_log_dir"] == str(run)
    events = EventAccumulator(str(run))
    events.Reload()
    steps = [(e.step, e.value) for e in events.Scalars("trial/accuracy")]
    assert steps == [(s, pytest.approx(v)) for s, v in sorted(frozen.intermediate_values.items())]
    content = events.PluginTagToContent("hparams")
    start = [
        plugin_data_pb2.HParamsPluginData.FromString(raw).session_start_info
        for raw in content.values()
        if plugin_data_pb2.HParamsPluginData.FromString(raw).HasField("session_start_info")
    ]
    assert len(start) == 1
    hparams = start[0].hparams
    assert hparams["x"].number_value == pytest.approx(frozen.params["x"])
    assert hparams["y"].number_value == frozen.params["y"]
    assert hparams["kind"].string_value == frozen.params["kind"]
    assert hparams["trial_state"].string_value == str(trial.state)  # STOPPED ones are marked
    final = [e.value for e in events.Scalars("accuracy")]  # the objective's own name
    assert final == [pytest.approx(list(frozen.intermediate_values.values())[-1])]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "space", "message"),
    [
        (
            [],
            {**SPACE, "z": hpt.DoubleParameterSpec(min=0, max=1)},
            "parameter 'z' is not accepted by script",
        ),
        (
            ["--mode", "silent"],
            SPACE,
            "the script exited 0 but never reported metric 'accuracy' (it reported nothing)",
        ),
        (["--mode", "wrong_tag"], SPACE, "never reported metric 'accuracy' (it reported ['loss'])"),
    ],
)
def test_setup_errors_stop_the_study_with_a_clear_error(tmp_path, args, space, message):
    job = make_job(tmp_path, "bad", args=args, space=space, parallel_trial_count=1)
    with pytest.raises(TuningError) as info:
        job.run()
    assert message in str(info.value)
    assert [str(t.state) for t in job.trials] == ["FAILED"]
    assert str(job.state) == "JOB_STATE_FAILED"


@pytest.mark.e2e
def test_one_tuner_per_study_and_a_resumed_study_keeps_its_space(tmp_path):
    import fcntl

    job = make_job(tmp_path, "locked", max_trial_count=1)
    job.study_dir.mkdir(parents=True)
    with open(job.study_dir / "tuner.lock", "a+") as lock:
        lock.write("12345")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running tuner holds it
        with pytest.raises(TuningError, match=r"is being run by another tuner \(pid 12345\)"):
            job.run()
    job.run()  # the lock is free again
    assert [str(t.state) for t in job.trials] == ["SUCCEEDED"]
    other_space = {**SPACE, "y": hpt.IntegerParameterSpec(min=1, max=9)}
    with pytest.raises(TuningError, match="was created with"):
        make_job(tmp_path, "locked", space=other_space, max_trial_count=2).run()
    with pytest.raises(TuningError, match="has no trials yet"):
        make_job(tmp_path, "never_ran").plot()


# --- the CLI, and a tuner killed mid-study -----------------------------------------------------


def write_spec(tmp_path, **overrides):
    spec = {
        "display_name": "killed",
        "custom_job": {
            "script_path": os.path.relpath(SCRIPT, tmp_path),
            "args": ["--mode", "hold", "--sync_dir", str(tmp_path)],
        },
        "metric_spec": {"accuracy": "maximize"},
        "parameter_spec": {
            "x": {"type": "double", "min": 0, "max": 1},
            "y": {"type": "integer", "min": 1, "max": 8},
            "kind": {"type": "categorical", "values": ["a", "b"]},
        },
        "max_trial_count": 5,
        "parallel_trial_count": 2,
        "seed": 0,
        "base_output_dir": "studies",
        **overrides,
    }
    path = tmp_path / "study.json"
    path.write_text(json.dumps(spec))
    return path


def wait_until(condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def tune_command(spec):
    return [sys.executable, "-m", "stratagem.cli", "tune", "--no-plot", str(spec)]


@pytest.mark.e2e
def test_tuner_killed_mid_study_resumes_to_max_trial_count(tmp_path):
    # No median rule: a later trial's only report may come in before its process exits, and a
    # low one would then (rightly) stop it, so the count of succeeded trials would hang on timing.
    spec = write_spec(tmp_path, median_stopping=False)
    database = tmp_path / "studies" / "killed" / "study.db"
    states = optuna.trial.TrialState

    def counts():
        # Read-only, through sqlite itself: opening the study with Optuna here would create its
        # tables if the tuner had not yet, racing the tuner's own creation of them.
        try:
            with contextlib.closing(
                sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5)
            ) as db:
                rows = db.execute("SELECT state FROM trials").fetchall()
        except sqlite3.OperationalError:  # no database or no tables yet, or busy
            return {}
        names = [state for (state,) in rows]
        return {s: names.count(s.name) for s in states}

    tuner = Process(tune_command(spec), child_env(), tmp_path, "tuner1")
    orphans = []
    try:
        # Trial 0 ends at once; trials 1 and 2 hold until released: two trials in flight.
        wait_until(
            lambda: counts().get(states.COMPLETE) == 1 and counts().get(states.RUNNING) == 2,
            "one trial finished and two running",
        )
        wait_until(lambda: len(list(tmp_path.glob("studies/killed/trials/*/seen-*"))) == 3,
                   "the running trials' tasks to start")  # fmt: skip
        orphans = [
            json.loads(p.read_text())["pid"]
            for p in tmp_path.glob("studies/killed/trials/*/seen-*")
        ]
        before = load_tuning_job(spec).trials[0]
        tuner.kill_group(signal.SIGKILL)  # the tuner only: its trials' tasks have own sessions
        tuner.wait(TIMEOUT_S)
    finally:
        (tmp_path / "release").touch()  # the orphaned trials end on their own
        for pid in orphans:
            wait_until(lambda pid=pid: not _alive(pid), f"orphaned task {pid} to end")

    result = subprocess.run(
        tune_command(spec), env=child_env(), cwd=tmp_path, capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(resuming after 3 trials)" in result.stderr
    database = tmp_path / "studies" / "killed" / "study.db"
    assert f"[stratagem] watch it with: optuna-dashboard sqlite:///{database}\n" in result.stderr
    runs_dir = tmp_path / "studies" / "killed" / "tensorboard"
    assert f"[stratagem] watch it with: tensorboard --logdir {runs_dir}\n" in result.stderr
    trials = load_tuning_job(spec).trials
    assert trials[0] == before and str(before.state) == "SUCCEEDED"
    interrupted = [t for t in trials if str(t.state) == "FAILED"]
    assert [t.id for t in interrupted] == ["1", "2"]
    for trial in interrupted:
        assert trial.error.startswith("the tuner stopped while this trial ran")
    succeeded = [t for t in trials if str(t.state) == "SUCCEEDED"]
    assert len(succeeded) == 5  # max_trial_count, the interrupted ones not counted
    rerun = [dict(t.parameters) for t in succeeded]
    for trial in interrupted:  # their parameters ran again
        assert dict(trial.parameters) in rerun
    # The live table and the best trial.
    assert result.stdout.startswith("trial  state")
    assert "best so far: trial" in result.stdout
    best = max(succeeded, key=lambda t: get_final_metric(t, "accuracy"))
    assert f"best trial {best.id}: accuracy=" in result.stdout


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.e2e
def test_cli_refuses_a_bad_study_file(tmp_path, capsys):
    spec = write_spec(tmp_path, parameter_spec={"x": {"type": "double", "min": 2, "max": 1}})
    assert cli.main(["tune", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stratagem tune: DoubleParameterSpec(min=2, max=1, scale='linear'): min")
    assert err.count("\n") == 1
    assert cli.main(["tune", str(tmp_path / "nope.json")]) == 2
    assert "study file" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_seed_search_example_smoke_run(tmp_path):
    # The seed's search space on digits, 2 trials of 1 epoch (the full run: docs/guides/tuning.md).
    argv = [sys.executable, str(REPO / "examples" / "tune.py"), "--max-trial-count", "2"]
    argv += ["--epochs", "1", "--output-dir", str(tmp_path / "out")]
    result = Process(argv, child_env(), tmp_path, "example", merge_output=True).wait(timeout=300)
    assert result.returncode == 0, result.stdout
    best_id = re.search(r"best_trial.id = '(\d+)'", result.stdout).group(1)
    study_dir = tmp_path / "out" / "my_hp_search_job"
    assert (study_dir / "trials" / best_id / "model" / "digits_mlp").is_dir()
    assert (study_dir / "study.png").is_file()
    summary = json.loads((study_dir / "study.json").read_text())
    assert [t["state"] for t in summary["trials"]] == ["SUCCEEDED", "SUCCEEDED"]
    for trial in summary["trials"]:
        assert set(trial["parameters"]) == {"learning_rate", "n_neurons", "n_hidden", "optimizer"}
        assert 0 <= trial["final_measurement"]["accuracy"] <= 1


# --- a GPU per trial (devices_per_trial) ---------------------------------------------------------


def test_device_groups_cut_the_visible_gpus_and_refuse_too_few():
    from stratagem.tune.gpu_groups import device_groups

    env = {"CUDA_VISIBLE_DEVICES": "4,7,2,5,GPU-abc"}
    assert device_groups(env, 2, 2) == ["4,7", "2,5"]  # the odd one out is left unused
    assert device_groups(env, 1, 3) == ["4", "7", "2", "5", "GPU-abc"]
    with pytest.raises(sg.tune.TuningConfigError, match=r"3 parallel trial\(s\) x "
                       r"devices_per_trial=2 need 6 GPUs; this machine has 5"):  # fmt: skip
        device_groups(env, 2, 3)


def test_devices_per_trial_is_checked_when_the_job_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(sg.tune.TuningConfigError, match="need 3 GPUs; this machine has 2"):
        make_job(tmp_path, "gpus", parallel_trial_count=3, max_trial_count=3, devices_per_trial=1)
    with pytest.raises(sg.tune.TuningConfigError, match="devices_per_trial must be an int >= 0"):
        make_job(tmp_path, "gpus", devices_per_trial=-1)
    # Fewer trials than the parallel count: only those need GPUs.
    job = make_job(tmp_path, "gpus", parallel_trial_count=4, max_trial_count=2, devices_per_trial=1)
    assert job.device_groups == ["0", "1"]
    # A study file takes it too.
    spec = write_spec(tmp_path, devices_per_trial=2, parallel_trial_count=1)
    assert load_tuning_job(spec).device_groups == ["0,1"]
    # Vertex AI's spelling: the trial template's accelerator_count, GPUs per trial.
    template = sg.jobs.CustomJob.from_local_script(
        "t", SCRIPT, accelerator_type="NVIDIA_TESLA_K80", accelerator_count=2
    )
    job = sg.tune.HyperparameterTuningJob(
        "vertex", template, metric_spec={"accuracy": "maximize"}, parameter_spec=SPACE,
        max_trial_count=2, parallel_trial_count=1, base_output_dir=tmp_path,
    )  # fmt: skip
    assert job.devices_per_trial == 2 and job.device_groups == ["0,1"]
    with pytest.raises(sg.tune.TuningConfigError, match="need 4 GPUs; this machine has 2"):
        sg.tune.HyperparameterTuningJob(
            "vertex", template, metric_spec={"accuracy": "maximize"}, parameter_spec=SPACE,
            max_trial_count=2, parallel_trial_count=2, base_output_dir=tmp_path,
        )  # fmt: skip
    with pytest.raises(sg.jobs.JobConfigError, match="accelerator_count must be an int >= 0"):
        sg.jobs.CustomJob("t", SCRIPT, accelerator_count=-1)


@pytest.mark.e2e
def test_two_parallel_trials_on_two_gpus_see_one_distinct_gpu_each(tmp_path, monkeypatch):
    # The device list is faked through the environment: the tuner hands out its entries.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    job = make_job(
        tmp_path, "gpus", max_trial_count=2, parallel_trial_count=2, devices_per_trial=1,
        median_stopping=False,
    )  # fmt: skip
    job.run()
    seen = [json.loads((t.job_dir / "seen-chief-0").read_text()) for t in job.trials]
    assert [s["cuda_visible_devices"] for s in seen] == ["0", "1"]
    assert {s["cuda_device_order"] for s in seen} == {"PCI_BUS_ID"}
    assert all(str(t.state) == "SUCCEEDED" for t in job.trials)


# --- the live table ---------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _screen(text: str) -> list[str]:
    """What a terminal shows after ``text``: lines, with cursor-up (ESC[nA) and clear-below
    (ESC[J), the only codes the table writes."""
    lines, row = [""], 0
    for token in re.split(r"(\x1b\[\d*[AJ]|\n)", text):
        if token == "\n":
            row += 1
            if row == len(lines):
                lines.append("")
        elif token.startswith("\x1b[") and token.endswith("A"):
            row -= int(token[2:-1])
        elif token == "\x1b[J":
            del lines[row + 1 :]
            lines[row] = ""
        elif token:
            lines[row] += token
    return [line for line in lines if line]


def _trial(number: int, state: str, accuracy=None):
    from stratagem.tune.trials import Measurement, Trial, TrialMetric, TrialState

    metrics = () if accuracy is None else (TrialMetric("accuracy", accuracy),)
    return Trial(str(number), {"x": 0.5}, TrialState[state], Measurement(0, metrics))


def test_the_table_refreshes_in_place_in_a_terminal_and_appends_elsewhere():
    events = [
        ("started", _trial(0, "ACTIVE")),
        ("started", _trial(1, "ACTIVE")),
        ("ended", _trial(1, "SUCCEEDED", 0.5)),
        ("started", _trial(2, "ACTIVE")),
        ("ended", _trial(0, "SUCCEEDED", 0.75)),
    ]
    terminal = _Terminal()
    table = sg.tune.TrialTable("accuracy", "maximize", ["x"], out=terminal)
    for event, trial in events:
        table(event, trial)
    assert "\x1b[" in terminal.getvalue()  # redrawn, not appended
    shown = [re.sub(r"\s+", " ", line).strip() for line in _screen(terminal.getvalue())]
    assert shown == [
        "trial state accuracy x",
        "1 SUCCEEDED 0.5 0.5",  # ended rows stay, in the order the trials ended
        "0 SUCCEEDED 0.75 0.5",
        "2 ACTIVE - 0.5",  # the trial still running, below them
        "best so far: trial 0, accuracy=0.75",
    ]
    pipe = io.StringIO()
    table = sg.tune.TrialTable("accuracy", "maximize", ["x"], out=pipe)
    for event, trial in events:
        table(event, trial)
    assert "\x1b" not in pipe.getvalue()
    assert len(pipe.getvalue().splitlines()) == 1 + len(events) + 2  # a row per event, 2 bests


@pytest.mark.e2e
def test_the_example_study_file_runs(tmp_path):
    """examples/study.json, the file `stratagem tune` reads: it loads as it is, and runs cut to
    one trial of one epoch (the same file otherwise)."""
    example = REPO / "examples" / "study.json"
    job = load_tuning_job(example, tmp_path / "as_is")
    assert (job.display_name, job.max_trial_count, job.metric_id) == (
        "digits_search",
        20,
        "accuracy",
    )
    assert job.custom_job.script_path == REPO / "examples" / "tune_trial.py"
    spec = json.loads(example.read_text())
    spec["custom_job"]["script_path"] = str(REPO / "examples" / "tune_trial.py")
    spec["custom_job"]["args"] = ["--epochs", "1"]
    spec["max_trial_count"] = 1
    (tmp_path / "study.json").write_text(json.dumps(spec))
    command = [*tune_command(tmp_path / "study.json"), "--base-output-dir", str(tmp_path / "out")]
    result = subprocess.run(
        command, env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^best trial 0: accuracy=", result.stdout, re.MULTILINE), result.stdout
    assert (tmp_path / "out" / "digits_search" / "trials" / "0" / "model").is_dir()
