"""Callbacks the DDP tests add to a real run: SampleProbe records what each rank saw and can make one rank fail;
KillAt SIGKILLs a rank at a forced moment (tests/test_torchrun_restart.py, tests/test_ddp.py)."""

import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


class SampleProbe(Callback):
    """Writes `<out_dir>/rank<r>.json`: per-epoch training indices, eval sample counts, the world size, and what
    this rank runs with (intra-op threads, the process group's collective timeout, the optimizer's lr).

    Args:
        out_dir: where to write (outside the run directory, which only rank 0 may write to).
        crash_rank: this rank raises after `crash_step` optimizer steps; -1 = nobody fails.
        crash_step: see crash_rank.
        usr1_step: every rank sends itself SIGUSR1 once `usr1_step` optimizer steps are done, as SLURM signals
            every task of a job (`--signal=SIGUSR1@90`) before its time limit; -1 = never.
    """

    def __init__(self, out_dir: str, crash_rank: int = -1, crash_step: int = 0, usr1_step: int = -1) -> None:
        self.out = Path(out_dir)
        self.crash_rank, self.crash_step, self.usr1_step = crash_rank, crash_step, usr1_step
        self.record: dict = {"train_epochs": [], "val": [], "test": []}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.record["world_size"] = trainer.world_size
        self.record["run_dir"] = (
            trainer.default_root_dir
        )  # the run directory this rank's command line resolved
        self.record["threads"] = torch.get_num_threads()
        self.record["omp_num_threads_env"] = os.environ.get("OMP_NUM_THREADS")
        if dist.is_available() and dist.is_initialized():
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # gloo's options carry the timeout
            self.record["pg_timeout_s"] = backend.options._timeout.total_seconds()
        if self._file(trainer).exists():  # a restarted rank: the epochs before its own
            self.record["train_epochs"] = json.loads(self._file(trainer).read_text())["train_epochs"]
        elif trainer.global_rank == 0:  # the starting weights, for the single-process replay
            torch.save(
                {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}, self.out / "init.pt"
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After a resume, the step the checkpoint was taken at; 0 for a fresh run.
        self.record["start_step"] = trainer.global_step
        # The lr each parameter group was built with (the scheduler keeps it as initial_lr; the schedule's peak).
        self.record["initial_lrs"] = [g["initial_lr"] for g in trainer.optimizers[0].param_groups]

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        # The training loader's EpochShard (kept by Lightning, not wrapped), already set_epoch()-ed for this epoch.
        sampler = loader.sampler
        consumed = len(loader) * loader.batch_size  # drop_last: the tail of the shard is never read
        # An epoch a restarted rank trains again replaces the record of the attempt that died in it.
        self.record["train_epochs"] = [e for e in self.record["train_epochs"] if e["epoch"] < sampler.epoch]
        self.record["train_epochs"].append(
            {
                "epoch": int(sampler.epoch),
                "sampler": type(sampler).__name__,
                "dataset": len(sampler.dataset),
                "indices": list(sampler)[:consumed],
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.crash_rank and trainer.global_step >= self.crash_step:
            (self.out / "crashed_at").write_text(repr(time.time()))  # the test times the shutdown from here
            raise RuntimeError(
                f"SampleProbe: rank {self.crash_rank} fails on purpose at step {trainer.global_step}"
            )
        if trainer.global_step == self.usr1_step:
            os.kill(os.getpid(), signal.SIGUSR1)  # Python runs the handler (Lightning's) before the next step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Before the epoch's checkpoint (Lightning runs checkpoint callbacks last): what a rank killed while it is
        # written had seen stays on disk.
        self._write(trainer)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Callbacks run before the module's hook, so the metric states are still this rank's own, unsynced.
        if not trainer.sanity_checking:
            self.record["val"].append(self._eval(trainer.val_dataloaders, pl_module.val_loss))

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["test"].append(self._eval(trainer.test_dataloaders, pl_module.test_loss))
        self._write(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer)

    def _file(self, trainer: L.Trainer) -> Path:
        return self.out / f"rank{trainer.global_rank}.json"

    def _write(self, trainer: L.Trainer) -> None:
        self._file(trainer).write_text(json.dumps(self.record))

    @staticmethod
    def _eval(loader, loss_metric) -> dict:
        # MeanMetric's `weight` state = samples this rank counted (the loss is updated with weight=batch size).
        return {
            "indices": list(loader.sampler),
            "counted": float(loss_metric.weight),
            "dataset": len(loader.dataset)
            if hasattr(loader, "dataset")
            else len(loader.labels),  # in-memory loader
        }


class PlainCNN(torch.nn.Module):
    """A BatchNorm-free, dropout-free CNN for the equivalence test.

    BatchNorm's running statistics differ by design under DDP (each rank updates them from its own batches and
    DDP broadcasts rank 0's), and dropout draws different masks per process: either makes a DDP run differ from
    its single-process replay for reasons other than the gradient reduction the test is about.
    """

    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 16) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(in_channels, width, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class KillAt(Callback):
    """SIGKILLs a rank at the first of `phases` not yet in the file `marker`, from epoch 1 on (after a checkpoint):
    `step` (rank 1, at the end of batch 1), `validation` (rank 1, at a validation batch's start), `checkpoint`
    (rank 0, the one writer: its checkpoint written into atomic_write's temporary file, not yet renamed). The phase
    goes into `marker` first, so each fires once and the restarted group moves on to the next; each process start
    is a line `start <rank>` in `<marker>.starts`."""

    def __init__(self, marker: str, phases: list[str]) -> None:
        self.marker, self.phases = Path(marker), phases

    def setup(self, trainer, pl_module, stage: str) -> None:
        done = self.marker.read_text().split() if self.marker.exists() else []
        self.due = next((p for p in self.phases if p not in done), None)
        with open(f"{self.marker}.starts", "a") as f:
            f.write(f"start {trainer.global_rank}\n")
        io = trainer.strategy.checkpoint_io
        if self.due == "checkpoint" and trainer.global_rank == 0:
            save = io.save_checkpoint

            def save_and_die(checkpoint, path, storage_options=None):
                if trainer.current_epoch >= 1:
                    real = torch.save

                    def written_then_killed(obj, f, *args, **kwargs):
                        real(obj, f, *args, **kwargs)
                        f.flush()
                        self.kill("checkpoint")

                    torch.save = written_then_killed
                save(checkpoint, path, storage_options)

            io.save_checkpoint = save_and_die

    def kill(self, phase: str) -> None:
        with open(self.marker, "a") as f:
            f.write(f"{phase}\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.due == "step" and trainer.global_rank == 1 and trainer.current_epoch >= 1 and batch_idx == 1:
            self.kill("step")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.due == "validation" and trainer.global_rank == 1 and trainer.current_epoch >= 1:
            if not trainer.sanity_checking:
                self.kill("validation")


def killing(marker: Path, phases: list[str]) -> list[str]:
    return ["--trainer.callbacks+=tests.ddp_probe.KillAt", f"--trainer.callbacks.marker={marker}",
            f"--trainer.callbacks.phases=[{','.join(phases)}]"]  # fmt: skip
