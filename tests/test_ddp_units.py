"""DDP logic that needs no second process: run directories under launchers, eval sharding, lr scaling."""

import multiprocessing
from types import SimpleNamespace

import pytest
import torch

from project.data import ImageClassificationDataModule
from project.errors import ConfigError
from project.module import ClassificationModule
from project.run_dir import check_writable, resolve_run_dir
from tests.ddp_probe import PlainCNN

LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID")


@pytest.fixture
def no_launcher(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("PROJECT_RUN_DIR", raising=False)
    return monkeypatch


def test_torchrun_ranks_derive_the_same_run_dir_from_the_rendezvous_id(no_launcher):
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "exp7")
    no_launcher.setenv("WORLD_SIZE", "4")
    assert str(resolve_run_dir(None, None)) == "runs/exp7"
    assert str(resolve_run_dir("runs/mine", None)) == "runs/mine"  # an explicit --run_dir still wins


def test_srun_tasks_share_a_run_dir_per_job(no_launcher):
    no_launcher.setenv("SLURM_PROCID", "3")
    no_launcher.setenv("SLURM_NTASKS", "8")
    no_launcher.setenv("SLURM_JOB_ID", "4242")
    assert str(resolve_run_dir(None, None)) == "runs/slurm-4242"


def test_torchrun_without_a_run_name_is_an_error_that_names_the_fix(no_launcher):
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default --rdzv_id
    no_launcher.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--run_dir|PROJECT_RUN_DIR"):
        resolve_run_dir(None, None)


def _check_run_dirs_in_step(runs, barrier, errors) -> None:
    for run_dir in runs:
        barrier.wait()  # every "rank" checks the same new directory at the same moment, as they do at start-up
        try:
            check_writable(run_dir)
        except ConfigError as err:
            errors.put(str(err))


def test_ranks_checking_one_new_run_dir_at_once_all_pass_and_leave_nothing(tmp_path):
    # Found by the two-node test: with one shared probe file name and the folders removed afterwards, one rank
    # deleted what another was checking ("is not writable (Directory not empty)"), and the other node's rank then
    # waited for it until the process group timed out.
    runs, ranks = [tmp_path / f"r{i}" / "runs" / "exp" for i in range(30)], 4
    ctx = multiprocessing.get_context("fork")
    barrier, errors = ctx.Barrier(ranks, timeout=30), ctx.SimpleQueue()
    procs = [ctx.Process(target=_check_run_dirs_in_step, args=(runs, barrier, errors)) for _ in range(ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0] * ranks
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, failures[:3]
    # nothing left behind
    assert not list(tmp_path.rglob("*.write-test*")) and not list(tmp_path.rglob("runs"))


@pytest.mark.parametrize("in_memory", [True, False], ids=["in-memory", "dataloader"])
def test_val_and_test_shards_cover_each_sample_exactly_once(in_memory):
    data = ImageClassificationDataModule(
        batch_size=32, val_fraction=0.1005, test_fraction=0.2005, in_memory=in_memory
    )
    data.setup("fit")
    for stage in ("val", "test"):
        seen = []
        for rank in range(3):  # 145 and 361 samples over 3 ranks: uneven shards
            cpu = SimpleNamespace(root_device=torch.device("cpu"))
            data.trainer = SimpleNamespace(world_size=3, global_rank=rank, strategy=cpu, overfit_batches=0)
            loader = getattr(data, f"{stage}_dataloader")()
            seen += list(loader.sampler)
        size = len(getattr(data, f"{stage}_set"))
        assert sorted(seen) == list(range(size)) and size % 3 != 0


def test_lr_scaling_linear_multiplies_by_world_size():
    module = ClassificationModule(PlainCNN(10), num_classes=10, lr=0.001)
    assert module.scaled_lr(8) == pytest.approx(0.001)  # default: the lr as configured
    linear = ClassificationModule(PlainCNN(10), num_classes=10, lr=0.001, lr_scaling="linear")
    assert linear.scaled_lr(8) == pytest.approx(0.008)
    optimizer = linear.configure_optimizers()["optimizer"]  # outside a Trainer: world size 1
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == pytest.approx(0.001)


def test_make_train_ddp_runs_the_command_the_ddp_test_runs(tmp_path):
    # `make -n` prints the recipe without running it (-o: never rebuild the environment). Without a GPU, NPROC is 2.
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = Path(sys.executable).parent.parent
    recipe = subprocess.run(
        [
            "make",
            "-n",
            "-o",
            str(venv / ".project-installed"),
            "train-ddp",
            f"VIRTUAL_ENV={venv}",
            "ARGS=--x 1",
        ],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    gpus = shutil.which("nvidia-smi") is not None
    expected = (
        "-m project fit --config configs/default.yaml --config configs/ddp.yaml "
        f"--trainer.devices {'auto' if gpus else 2} --trainer.num_nodes 1 --x 1"
    )
    assert expected in recipe, recipe
