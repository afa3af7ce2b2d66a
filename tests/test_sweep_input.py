"""`make sweep` refuses bad input before its first trial (project/sweep/check.py, project/sweep/space.py), leaves an
existing study untouched when it does, lets a corrected sweep run past earlier failures, and draws an honest
report.png (project/sweep/report.py).

In-process (`project.sweep.main`), with the repository's configs. Most checks train nothing; the metric check runs
its one-batch dry run (a `python -m project fit --trainer.fast_dev_run 1` process) once for the file (`one_dry_run`).
"""

import hashlib
import signal
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from project.sweep import main as sweep_main
from tests.conftest import CONFIGS, REPO

LR = "model.init_args.optimizer.init_args.lr"
WIDTH = "model.init_args.model.init_args.width"
FAST = {
    "trainer.max_epochs": 1,
    "trainer.limit_train_batches": 4,
    "trainer.limit_val_batches": 2,
    "trainer.limit_test_batches": 2,
}
DISTRIBUTIONS = {LR: FloatDistribution(1.0e-4, 1.0e-2, log=True), WIDTH: CategoricalDistribution([16, 32])}


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the sweep's default base config is configs/default.yaml, relative


DRY_RUNS: dict[str, list[str]] = {}


@pytest.fixture
def one_dry_run(monkeypatch):
    """The metric check's one-batch dry run, run for real once in this file: every sweep here has the same base
    config and fixed keys, and what a trial logs does not depend on the searched values, so each reports the same
    metrics."""
    import project.sweep.check

    real = project.sweep.check.reported_metrics

    def once(*args) -> list[str]:
        if "names" not in DRY_RUNS:
            DRY_RUNS["names"] = real(*args)
        return DRY_RUNS["names"]

    monkeypatch.setattr(project.sweep.check, "reported_metrics", once)


def write_space(path: Path, **overrides) -> Path:
    space = {
        "name": "t",
        "n_trials": 1,
        "enqueue_base": False,
        "sampler": {"class_path": "optuna.samplers.RandomSampler", "init_args": {"seed": 0}},
        "fixed": dict(FAST),
        "params": {
            LR: {"type": "float", "low": 1.0e-4, "high": 1.0e-2, "log": True},
            WIDTH: {"type": "categorical", "choices": [16, 32]},
        },
        **overrides,
    }
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def sweep(space: Path, sweep_dir: Path, *extra: str) -> int:
    """`python -m project sweep` in this process; its exit code."""
    argv = ["--space", str(space), "--dir", str(sweep_dir), "--config", str(CONFIGS / "default.yaml")]
    with pytest.raises(SystemExit) as exited:
        sweep_main([*argv, "--max_failed", "1", *extra])
    return exited.value.code


def refused(capsys, *needles: str) -> str:
    """The error paragraph, which must name each of `needles`; it is one paragraph (no blank line inside)."""
    err = capsys.readouterr().err
    paragraph = err.strip()
    assert paragraph.startswith("error:") and "\n\n" not in paragraph, err
    for needle in needles:
        assert needle in paragraph, (needle, err)
    return paragraph


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def existing_study(sweep_dir: Path, space: Path, failed: int = 0) -> dict[str, str]:
    """A sweep directory as a finished sweep leaves it: study.db (two complete trials, `failed` failed ones),
    space.yaml, best.yaml, report.png and trials.csv; its files' hashes."""
    from project.sweep.storage import default_storage, open_storage

    sweep_dir.mkdir(parents=True)
    study = optuna.create_study(
        study_name="t", storage=open_storage(default_storage(sweep_dir)), direction="minimize"
    )
    study.set_user_attr("metric", "val/loss")  # the metric its values are (project/sweep/__init__.py)
    for value, lr in ((0.61, 3.0e-3), (0.58, 1.0e-3)):
        study.add_trial(create_trial(params={LR: lr, WIDTH: 16}, distributions=DISTRIBUTIONS, value=value))
    for _ in range(failed):
        study.add_trial(
            create_trial(
                state=TrialState.FAIL,
                params={LR: 1.0e-3, WIDTH: 16},
                distributions=DISTRIBUTIONS,
                user_attrs={"error": "exit code 2: error: no such key"},
            )
        )
    for number, lr in enumerate((3.0e-3, 1.0e-3)):  # each trial's run directory (its overlay, for best.yaml)
        (sweep_dir / "trials" / f"{number:03d}").mkdir(parents=True)
        overlay = {LR: lr}  # dotted keys, as the CLI reads them
        (sweep_dir / "trials" / f"{number:03d}" / "sweep_trial.yaml").write_text(yaml.safe_dump(overlay))
    (sweep_dir / "space.yaml").write_text(space.read_text())
    (sweep_dir / "best.yaml").write_text("# Best trial of sweep 't': trial 1, val/loss = 0.58\n")
    (sweep_dir / "report.png").write_bytes(b"\x89PNG not really")
    (sweep_dir / "trials.csv").write_text("number,state,value\n0,COMPLETE,0.61\n1,COMPLETE,0.58\n")
    return snapshot(sweep_dir)


@pytest.mark.claim("sweep-bad-input-before-trials")
@pytest.mark.parametrize(
    "param, needles",
    [
        ({"type": "float", "low": 0.0, "high": 0.1, "log": True}, ["`low > 0` must hold for `log=True`"]),
        ({"type": "float", "low": 0.2, "high": 0.1}, ["`low <= high` must hold"]),
        ({"type": "float", "low": "1e-4", "high": 0.1}, ["string bound", "write 1.0e-3"]),
        (
            {"type": "float", "low": 1.0e-4, "high": 0.1, "log": True, "step": 0.01},
            ["`step` is not supported"],
        ),
        ({"type": "categorical", "choices": [{"a": 1}]}, ["Choices for a categorical distribution"]),
    ],
    ids=["log-low-0", "low-above-high", "yaml-string", "log-and-step", "mapping-choice"],
)
def test_bad_range_exits_2_before_any_trial(tmp_path, capsys, param, needles):
    """A range Optuna refuses in every trial (its distribution's own message), or YAML reads as a string, is one
    paragraph naming the key; nothing is created (no sweep directory, no study.db, no trials/)."""
    space = write_space(tmp_path / "t.yaml", params={LR: param})
    assert sweep(space, tmp_path / "sweep") == 2
    refused(capsys, f"parameter '{LR}'", *needles)
    assert not (tmp_path / "sweep").exists()


def test_every_problem_of_a_sweep_file_in_one_paragraph(tmp_path, capsys):
    """Several mistakes are named together (fixing one at a time costs a run each)."""
    space = write_space(
        tmp_path / "t.yaml",
        params={
            LR: {"type": "floatt", "low": 1.0e-4, "high": 0.1},
            WIDTH: {"type": "categorical", "choices": []},
        },
        pruner={"class_path": "optuna.pruners.MedianPrunerr"},
    )
    assert sweep(space, tmp_path / "sweep") == 2
    refused(
        capsys,
        f"parameter '{LR}' has type 'floatt'",
        f"parameter '{WIDTH}'",
        "one or more elements",
        "Nothing",
    )
    assert not (tmp_path / "sweep").exists()


def test_bad_pruner_exits_2_before_the_storage_is_created(tmp_path, capsys):
    space = write_space(tmp_path / "t.yaml", pruner={"class_path": "optuna.pruners.MedianPrunerr"})
    assert sweep(space, tmp_path / "sweep") == 2
    refused(capsys, "optuna.pruners.MedianPrunerr")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.claim("sweep-bad-input-before-trials")
def test_misspelled_keys_exit_2_with_the_closest_key(tmp_path, capsys):
    """Misspelled searched and fixed keys, each named with the key the training CLI has, before any trial (before,
    each of n_trials trials failed on them in turn)."""
    space = write_space(
        tmp_path / "t.yaml",
        fixed={**FAST, "trainer.max_epoch": 1, "data.init_args.batch_sizee": 32},
        params={"model.init_args.optimizer.init_args.lrr": {"type": "float", "low": 1.0e-4, "high": 0.1}},
    )
    assert sweep(space, tmp_path / "sweep") == 2
    refused(
        capsys,
        f"'model.init_args.optimizer.init_args.lrr' is no key of the training config (did you mean '{LR}'?)",
        "'trainer.max_epoch' is no key of the training config (did you mean 'trainer.max_epochs'?)",
        "'data.init_args.batch_sizee' is no key of the training config (did you mean 'data.init_args.batch_size'?)",
    )
    assert not (tmp_path / "sweep").exists()


def test_a_refused_choice_exits_2_naming_the_key_and_value(tmp_path, capsys):
    """Every choice is parsed, not only the one a trial happens to draw first: an optimizer class path with a typo
    among valid ones is found before any trial."""
    optimizer = "model.init_args.optimizer"
    space = write_space(
        tmp_path / "t.yaml",
        params={optimizer: {"type": "categorical", "choices": ["torch.optim.AdamW", "torch.optim.Adamm"]}},
    )
    assert sweep(space, tmp_path / "sweep") == 2
    refused(capsys, f"{{'{optimizer}': 'torch.optim.Adamm'}}", "Did you mean torch.optim.Adam?")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.claim("sweep-bad-input-before-trials")
@pytest.mark.parametrize(
    "metric, direction, needles",
    [
        ("val/los", "minimize", ["metric 'val/los' is not one a trial reports", "Did you mean 'val/loss'?"]),
        # logged only by the test after fit: no trial reports it to the pruner, and ranking by it would be
        # selecting on the test split
        ("test/acc", "maximize", ["metric 'test/acc' is not one a trial reports", "val/acc"]),
    ],
)
def test_a_metric_no_trial_reports_exits_2_before_any_trial(
    tmp_path, capsys, metric, direction, needles, one_dry_run
):
    """The metric is checked against what the module logs after a validation (one-batch dry run), before any
    trial; before, each trial trained to its end and then failed for want of the metric."""
    space = write_space(tmp_path / "t.yaml", metric=metric, direction=direction)
    assert sweep(space, tmp_path / "sweep") == 2
    refused(capsys, *needles)
    assert not (tmp_path / "sweep").exists()
    assert {"val/loss", "val/acc"} <= set(DRY_RUNS["names"]) and "test/acc" not in DRY_RUNS["names"], DRY_RUNS


@pytest.mark.claim("sweep-bad-input-before-trials")
def test_bad_input_leaves_an_existing_study_unchanged(tmp_path, capsys, one_dry_run):
    """Against an existing sweep directory, each bad input exits 2 and changes no byte in it (space.yaml, best.yaml,
    report.png, trials.csv, study.db, trials/) and starts no trial. The study already has n_trials complete trials, so the
    old code ran none either, but rewrote space.yaml, best.yaml and the report with the bad input's metric."""
    good = write_space(tmp_path / "good.yaml", n_trials=2)
    sweep_dir = tmp_path / "sweep"
    before = existing_study(sweep_dir, good)
    cases = {
        "misspelled key": (
            write_space(tmp_path / "a.yaml", n_trials=2, fixed={**FAST, "trainer.max_epoch": 1}),
            [],
        ),
        "log with low 0": (
            write_space(
                tmp_path / "b.yaml",
                n_trials=2,
                params={LR: {"type": "float", "low": 0, "high": 1, "log": True}},
            ),
            [],
        ),
        "unknown metric": (
            write_space(tmp_path / "c.yaml", n_trials=2, metric="val/los", direction="minimize"),
            [],
        ),
        "another metric": (
            write_space(tmp_path / "d.yaml", n_trials=2, metric="val/acc", direction="maximize"),
            [],
        ),
        "report, unknown metric": (
            write_space(tmp_path / "e.yaml", n_trials=2, metric="val/los", direction="minimize"),
            ["--report"],
        ),
        "report, another metric": (
            write_space(tmp_path / "f.yaml", n_trials=2, metric="val/acc", direction="maximize"),
            ["--report"],
        ),
    }
    said = {}
    for case, (space, extra) in cases.items():
        assert sweep(space, sweep_dir, *extra) == 2, case
        said[case] = refused(capsys)
        assert snapshot(sweep_dir) == before, case  # no new trial directory either
    # the study's metric is named when another is asked for
    assert "ranks its trials by val/loss (minimize), not val/acc (maximize)" in said["another metric"], said


def test_earlier_failures_do_not_block_a_corrected_extend(tmp_path, capsys, fast_trials):
    """--max_failed counts the failures of this command: a study with two failed trials from an earlier run (a key
    since corrected) runs the corrected sweep's trial with --max_failed 1 (before: it stopped at once, exit 1)."""
    good = write_space(tmp_path / "good.yaml", n_trials=3)
    sweep_dir = tmp_path / "sweep"
    existing_study(sweep_dir, good, failed=2)
    assert sweep(good, sweep_dir) == 0, capsys.readouterr()
    trials = optuna.load_study(study_name="t", storage=f"sqlite:///{sweep_dir / 'study.db'}").get_trials()
    assert [t.state for t in trials].count(TrialState.COMPLETE) == 3


def test_report_draws_optunas_plots(tmp_path):
    """The report's plots are Optuna's: the history, every trial's curve (pruned ones too) and the importances."""
    from project.sweep.report import plot

    study = optuna.create_study(direction="minimize")
    for i in range(10):
        params = {LR: 1.0e-4 * (1.5**i), WIDTH: (16, 32)[i % 2]}
        values = {0: 0.9, 1: 0.5 + 0.01 * i}
        study.add_trial(
            create_trial(
                params=params, distributions=DISTRIBUTIONS, value=values[1], intermediate_values=values
            )
        )
    study.add_trial(
        create_trial(
            state=TrialState.PRUNED,
            params={LR: 1.0e-3, WIDTH: 16},
            distributions=DISTRIBUTIONS,
            intermediate_values={0: 0.95},
        )
    )
    plot(study, tmp_path, "val/loss")
    for name in ("report.png", "curves.png", "importances.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name


def files(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file's hash and mtime: a refusal changes nothing, not even a file's time."""
    return {k: (v, (folder / k).stat().st_mtime_ns) for k, v in snapshot(folder).items()}


@pytest.fixture
def fast_trials(monkeypatch, tmp_path):
    """Sweeps whose input check and trials are not the test's subject: a trial writes its summary.json at once
    (the stub trial of tests/stub_trials/sitecustomize.py, with no file to wait for)."""
    import sys

    import project.sweep.check
    import project.sweep.worker
    from tests.stub_trials.sitecustomize import TRIAL

    hold = str(tmp_path / "no-hold")
    monkeypatch.setattr(project.sweep.check, "check_inputs", lambda *args: ("val/loss", "minimize", {}))
    monkeypatch.setattr(
        project.sweep.worker,
        "fit_command",
        lambda configs, overlay, run_dir: [sys.executable, "-c", TRIAL, str(run_dir), hold],
    )
    handler = signal.getsignal(signal.SIGTERM)  # the sweep turns SIGTERM into a stop of its trial
    yield
    signal.signal(signal.SIGTERM, handler)


@pytest.mark.claim("sweep-refusals")
def test_a_space_the_study_cannot_continue_exits_2_and_changes_nothing(tmp_path, capsys, fast_trials):
    """The sweep file of an existing study edited: the categorical's choices narrowed. Optuna cannot continue a study
    whose categorical changed its choices: one paragraph, exit 2, and no file of the sweep directory changed (before,
    the sweep crashed with a traceback in its first trial and added a failed trial to study.db)."""
    sweep_dir = tmp_path / "sweep"
    existing_study(sweep_dir, write_space(tmp_path / "good.yaml", n_trials=3))
    before = files(sweep_dir)
    narrowed = write_space(
        tmp_path / "t.yaml",
        n_trials=3,
        params={
            **yaml.safe_load((tmp_path / "good.yaml").read_text())["params"],
            WIDTH: {"type": "categorical", "choices": [16]},
        },
    )
    assert sweep(narrowed, sweep_dir) == 2
    refused(capsys, f"'{WIDTH}'", "choices", "Nothing was changed")
    assert files(sweep_dir) == before


@pytest.mark.claim("sweep-refusals")
def test_a_directory_that_holds_another_study_exits_2_and_changes_nothing(tmp_path, capsys, fast_trials):
    """Two sweep files (two studies) given the same --dir: the second is refused in one paragraph, exit 2, and no
    file of the directory changes (before, it wrote its trials into the same trials/NNN folders, its summaries and
    best.yaml over the first's)."""
    sweep_dir = tmp_path / "sweep"
    assert sweep(write_space(tmp_path / "t.yaml", n_trials=1), sweep_dir) == 0
    assert (sweep_dir / "trials" / "000" / "summary.json").is_file()
    before = files(sweep_dir)
    assert sweep(write_space(tmp_path / "u.yaml", name="u", n_trials=1), sweep_dir) == 2
    refused(capsys, str(sweep_dir), "study 't'", "Nothing was changed")
    assert files(sweep_dir) == before
