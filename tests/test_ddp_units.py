"""DDP logic that needs no second process: run directories under launchers, eval sharding, lr scaling, the
launchers' device count, sync_batchnorm on CPU, and the bit-for-bit comparison the equivalence test relies on."""

import functools
import importlib
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from project.data import ImageClassificationDataModule
from project.errors import ConfigError
from project.module import ClassificationModule
from project.run_dir import check_writable, resolve_run_dir
from tests.conftest import CONFIGS, QUIET, REPO, run_cli, user_environment
from tests.ddp_probe import PlainCNN
from tests.ddp_processes import QUICK_DEADLINE_S
from tests.ddp_replay import interleaved, replay, weight_difference

LAUNCHER_VARS = (
    "TORCHELASTIC_RUN_ID",
    "WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
    "SLURM_RESTART_COUNT",
)


@pytest.fixture
def no_launcher(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.claim("ddp-torchrun-run-name")
def test_torchrun_ranks_derive_the_same_run_dir_from_the_rendezvous_id(no_launcher):
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "exp7")
    no_launcher.setenv("WORLD_SIZE", "4")
    assert str(resolve_run_dir(None, None)) == "runs/exp7"
    assert str(resolve_run_dir("runs/mine", None)) == "runs/mine"  # an explicit --run_dir still wins


@pytest.mark.claim("ddp-slurm-requeue")
def test_srun_tasks_share_a_run_dir_per_job(no_launcher, in_tmp):
    no_launcher.setenv("SLURM_PROCID", "3")
    no_launcher.setenv("SLURM_NTASKS", "8")
    no_launcher.setenv("SLURM_JOB_ID", "4242")
    assert str(resolve_run_dir(None, None)) == "runs/slurm-4242"


@pytest.mark.claim("ddp-one-run-dir")
def test_lightning_launched_ranks_get_the_run_dir_on_their_command_line(no_launcher, in_tmp):
    # `make train-ddp`: Lightning starts ranks 1.. by re-running sys.argv. Rank 0 appends the directory it chose,
    # so a rank started seconds later parses the same one instead of a timestamp of its own; no environment
    # variable carries it (one would stay set for a second run in this process), and nothing is created yet.
    from project.cli import build_cli

    no_launcher.setattr(sys, "argv", ["project", "--trainer.max_epochs", "1", "--test_after_fit", "false"])
    rank0 = build_cli(run=False)  # parses sys.argv, as `python -m project fit ...` does
    chosen = rank0.config.run_dir
    assert re.fullmatch(r"runs/\d{8}-\d{6}(-\d+)?", chosen) and sys.argv[-2:] == ["--run_dir", chosen]
    assert chosen not in os.environ.values() and not (in_tmp / "runs").exists()
    time.sleep(1.1)  # a new second: a rank choosing for itself would now get another timestamp
    child = build_cli(run=False)
    assert child.config.run_dir == chosen and sys.argv.count("--run_dir") == 1
    # A run given its arguments as a list (a notebook, a test) leaves sys.argv alone.
    build_cli(["--trainer.max_epochs", "1"], run=False)
    assert sys.argv.count("--run_dir") == 1


@pytest.mark.claim("ddp-torchrun-run-name")
def test_torchrun_without_a_run_name_is_an_error_that_names_the_fix(no_launcher):
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default --rdzv_id
    no_launcher.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--run_dir"):
        resolve_run_dir(None, None)


def _check_run_dirs_in_step(runs, barrier, errors) -> None:
    for run_dir in runs:
        barrier.wait()  # every "rank" checks the same new directory at the same moment, as they do at start-up
        try:
            check_writable(run_dir)
        except ConfigError as err:
            errors.put(str(err))


@pytest.mark.claim("ddp-one-run-dir")
def test_ranks_checking_one_new_run_dir_at_once_all_pass_and_leave_nothing(tmp_path):
    # Found by the two-node test: with one shared probe file name and the folders removed afterwards, one rank
    # deleted what another was checking ("is not writable (Directory not empty)"), and the other node's rank then
    # waited for it until the process group timed out.
    runs, ranks = [tmp_path / f"r{i}" / "runs" / "exp" for i in range(30)], 4
    ctx = multiprocessing.get_context("fork")
    # Deadlines (barrier, join): a hang fails the test instead of blocking the suite.
    barrier, errors = ctx.Barrier(ranks, timeout=QUICK_DEADLINE_S), ctx.SimpleQueue()
    procs = [ctx.Process(target=_check_run_dirs_in_step, args=(runs, barrier, errors)) for _ in range(ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=2 * QUICK_DEADLINE_S)
    assert [proc.exitcode for proc in procs] == [0] * ranks
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, failures[:3]
    # nothing left behind
    assert not list(tmp_path.rglob("*.write-test*")) and not list(tmp_path.rglob("runs"))


@pytest.mark.claim("ddp-eval-counted-once")
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
            data.trainer = SimpleNamespace(
                world_size=3, num_devices=3, global_rank=rank, strategy=cpu, overfit_batches=0
            )
            loader = getattr(data, f"{stage}_dataloader")()
            seen += list(loader.sampler)
        size = len(getattr(data, f"{stage}_set"))
        assert sorted(seen) == list(range(size)) and size % 3 != 0


@pytest.mark.claim("ddp-lr-scaling")
def test_lr_scaling_linear_multiplies_by_world_size():
    def adamw(params):
        return torch.optim.AdamW(params, lr=0.001)

    module = ClassificationModule(PlainCNN(10), num_classes=10, optimizer=adamw)
    assert module.scaled_lr(8) == 0.001  # default: the lr as configured, untouched
    linear = ClassificationModule(PlainCNN(10), num_classes=10, optimizer=adamw, lr_scaling="linear")
    assert linear.scaled_lr(8) == 0.001 * 8  # the same product the module computes: exact equality
    optimizer = linear.configure_optimizers()["optimizer"]  # outside a Trainer: world size 1
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 0.001


def _stand_ins(tmp_path: Path, gpus: int) -> dict:
    """PATH with a stand-in `nvidia-smi` first (listing `gpus` GPUs, or failing as it does on a machine without
    any), and PY = a stand-in python that prints the command it was given instead of running it."""
    bin_dir = tmp_path / f"bin-{gpus}"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(gpus))
    smi.write_text("#!/usr/bin/env bash\n" + (lines if gpus else "exit 9\n"))
    echo = bin_dir / "echo-python"
    echo.write_text('#!/usr/bin/env bash\necho "$*"\n')
    for f in (smi, echo):
        f.chmod(0o755)
    # Without what `make test ARGS=...` passes down to every make (NPROC among them).
    env = user_environment()
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PY": str(echo)}


@pytest.mark.claim("ddp-make-train-ddp", "ddp-torchrun-nodes")
def test_make_and_torchrun_sh_start_one_process_per_gpu_or_two_without(tmp_path):
    # The GPU branch of the launchers' device count, which a CPU machine never takes: `make train-ddp` itself
    # runs in the README-commands test (NPROC=2 here); this evaluates make's NPROC and runs scripts/torchrun.sh
    # (with a stand-in python) under a stand-in nvidia-smi with 8 GPUs, and without any.
    print_nproc = [
        "make",
        "-s",
        "--no-print-directory",
        "--eval",
        "print-nproc: ; @echo $(NPROC)",
        "print-nproc",
    ]
    for gpus, nproc in ((0, "2"), (8, "auto")):
        env = _stand_ins(tmp_path, gpus)
        made = subprocess.run(
            print_nproc, cwd=REPO, env=env, capture_output=True, text=True, timeout=QUICK_DEADLINE_S
        )
        assert made.returncode == 0 and made.stdout.strip() == nproc, made
        one_node = subprocess.run(
            [REPO / "scripts/torchrun.sh", "--", "--trainer.max_epochs", "5"],
            env=env,
            capture_output=True,
            text=True,
            timeout=QUICK_DEADLINE_S,
        )
        assert one_node.returncode == 0, one_node.stderr
        procs = "2" if gpus == 0 else str(gpus)  # torchrun.sh: the GPU count, or 2 CPU processes
        words = one_node.stdout.split()
        # a timestamp: one node needs no --run_id. Every rank names its run directory runs/<rendezvous id>.
        run_id = words[words.index("--rdzv_id") + 1]
        assert re.fullmatch(r"\d{8}-\d{6}", run_id), run_id
        assert one_node.stdout.startswith(
            f"-m torch.distributed.run --nnodes 1 --nproc_per_node {procs} --max_restarts 3 "
        )
        assert f"--trainer.devices {procs} --trainer.num_nodes 1 --trainer.max_epochs 5" in one_node.stdout

    # Several nodes: one --run_id for all of them, or the script refuses and says what to pass.
    nodes = [REPO / "scripts/torchrun.sh", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1"]
    refused = subprocess.run(nodes, env=env, capture_output=True, text=True, timeout=QUICK_DEADLINE_S)
    assert refused.returncode == 2 and "pass --run_id NAME, the same on every node" in refused.stderr
    second = subprocess.run(
        [*nodes, "--run_id", "exp1"], env=env, capture_output=True, text=True, timeout=QUICK_DEADLINE_S
    ).stdout
    assert second.startswith("-m torch.distributed.run --nnodes 2 --nproc_per_node 8")
    assert "--rdzv_endpoint 10.0.0.1:29500 --rdzv_id exp1 --rdzv_conf is_host=0" in second
    # devices x num_nodes = torchrun's world size
    assert "--trainer.devices 8 --trainer.num_nodes 2" in second


@pytest.mark.claim("ddp-sync-batchnorm")
def test_sync_batchnorm_is_off_in_ddp_yaml_and_on_cpu_an_error_naming_the_fix(in_tmp, capsys):
    assert yaml.safe_load((CONFIGS / "ddp.yaml").read_text())["trainer"]["sync_batchnorm"] is False
    # Asking for it on CPU stops before training (SyncBatchNorm is CUDA-only). One device: the same check, and
    # should it ever be missing, no DDP launcher re-runs this pytest command as a second rank.
    code = run_cli(
        "fit",
        "--config",
        CONFIGS / "default.yaml",
        "--config",
        CONFIGS / "ddp.yaml",
        "--trainer.devices",
        "1",
        "--trainer.accelerator",
        "cpu",
        "--trainer.sync_batchnorm",
        "true",
        *QUIET,
        "--trainer.max_epochs",
        "1",
        "--trainer.limit_train_batches",
        "2",
    )
    err = capsys.readouterr().err
    assert code == 2 and "Set --trainer.sync_batchnorm false." in err, err[-2000:]
    assert not (in_tmp / "runs").exists() or not list((in_tmp / "runs").rglob("*.ckpt"))


def configured_class(entry: dict) -> type:
    module, name = entry["class_path"].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


class SummedLoss(ClassificationModule):
    """The loss a sum over 2 ranks' gradients gives where the mean was meant: twice the mean."""

    def training_step(self, batch, batch_idx):
        return 2 * super().training_step(batch, batch_idx)


@pytest.mark.claim("ddp-equivalence")
def test_the_replay_comparison_catches_a_sum_instead_of_a_mean():
    # The DDP equivalence test compares the DDP run bit for bit with a one-process replay (tests/ddp_replay.py).
    # Here, in one process, that comparison must (1) find two replays of the same reference identical, so a
    # difference can only come from the computation, and (2) report a sum instead of a mean. AdamW divides the
    # gradient by the root of its running square: x2 changes the update only through eps, by ~1e-7 here, which a
    # loose tolerance would not see.
    data = ImageClassificationDataModule(batch_size=32, augment="none")
    data.setup("fit")
    x = torch.stack([data.train_set[i][0] for i in range(320)])
    y = torch.tensor([data.train_set[i][1] for i in range(320)])
    ranks = [[list(range(r, 320, 2))] for r in range(2)]  # 1 epoch, 2 "ranks" x 5 batches of 32: 5 steps
    epochs = interleaved(ranks, 32)
    config = yaml.safe_load((CONFIGS / "default.yaml").read_text())["model"]["init_args"]
    hparams = {
        "optimizer": functools.partial(
            configured_class(config["optimizer"]), **config["optimizer"]["init_args"]
        ),
        "scheduler": functools.partial(
            configured_class(config["scheduler"]), **config["scheduler"]["init_args"]
        ),
        **{k: config[k] for k in ("label_smoothing", "channels_last")},
    }

    def train(module_class) -> dict:
        torch.manual_seed(0)
        module = module_class(PlainCNN(10), num_classes=10, **hparams)
        trainer = replay(module, x, y, epochs, accumulate=2, trainer_kwargs={"deterministic": True})
        assert trainer.global_step == 5
        return module.state_dict()

    reference = train(ClassificationModule)
    assert weight_difference(reference, train(ClassificationModule)) == ([], 0.0)
    differ, diff = weight_difference(reference, train(SummedLoss))
    print(
        f"\nloss x2 (a sum over 2 ranks instead of the mean) after 5 steps: max abs weight difference {diff:.2e}"
    )
    assert differ  # every weight moved differently; the bias of a layer may by chance not


def test_the_world_line_names_the_backend_before_the_process_group_exists(no_launcher):
    # The CLI prints the world before trainer.fit sets up DDP: no process group yet, and the strategy's
    # process_group_backend still None. The backend named must be the one DDP then starts, not "None" or "?".
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy

    from project.distributed import describe_world, process_group_backend

    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False)
    assert not torch.distributed.is_initialized() and trainer.strategy.process_group_backend is None
    assert describe_world(trainer, 32, 0.003) == (
        "DDPStrategy: world size 2 = 2 per node x 1 node, CPU processes with gloo (no GPU in use). "
        "Per-device batch 32, effective global batch 64. Peak lr 0.003."
    )
    cuda = DDPStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    configured = DDPStrategy(parallel_devices=[torch.device("cpu")] * 2, process_group_backend="nccl")
    for strategy in (trainer.strategy, cuda, configured):
        # The rule Lightning's DDP setup applies (a private method: read here only, to catch a change of it).
        assert process_group_backend(strategy) == strategy._get_process_group_backend()
    assert [process_group_backend(s) for s in (cuda, configured)] == ["nccl", "nccl"]
