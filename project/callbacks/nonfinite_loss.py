"""NonFiniteLossGuard: a NaN or inf loss never reaches the weights or a checkpoint, and the run stops naming it."""

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from project.errors import ConfigError

# The loss value kinds, ordered so that an all-reduce "max" picks one: 0 finite, then inf, -inf, nan.
_KINDS = {1: "inf", 2: "-inf", 3: "nan"}


class NonFiniteLossError(ConfigError):
    """The training loss became NaN or inf; the message names where and what to try."""


class NonFiniteLossGuard(Callback):
    """Skips every optimizer step from the first non-finite loss on, on the device, and stops the run at the
    next point where the host reads anyway: no device-to-host sync in the steady-state training step.

    Why not a host check per step (`loss.item()` before backward, as this callback did): on a GPU that read stalls
    the launch queue every step. Why not Lightning's stock features: `Trainer(detect_anomaly=True)` finds the op
    but costs several times the step (configs/debug/detect_anomaly.yaml); EarlyStopping(check_finite=True) reads
    a logged metric, after the NaN step has already moved the weights.

    How, per step, all on the device: a sticky flag `bad` is or-ed with `~isfinite(loss)` before backward, and
    the index of the first bad batch and the kind of its loss are kept beside it. Before the optimizer step:

    - optimizers with `found_inf` support (torch's fused AdamW/Adam/SGD, `_step_supports_amp_scaling`: the
      default fused AdamW) get `optimizer.found_inf = bad`, the flag GradScaler hands them: the fused kernel
      leaves parameters, moments and step count untouched when it is set. From the first bad batch on every
      update is skipped, so the weights stay those of the last good step.
    - any other optimizer (or a GradScaler run, `16-mixed`, whose scaler replaces `found_inf` with its own
      gradient check) falls back to reading the flag on the host before each step: one sync per step, the
      cost this design removes elsewhere. Zeroing the gradients instead would not skip the step: AdamW's
      momentum and weight decay still move every weight.

    The flag is read (and the run stopped) at the end of each training epoch's last batch (before validation),
    every `check_every_n_steps` training batches, before every checkpoint is written (on_save_checkpoint: a
    checkpoint never holds a state after the bad step), and at the end of training. At most
    `check_every_n_steps` batches are computed in vain; the error names the first bad one.

    Under DDP the ranks agree: the flag is all-reduced (max) at each of those points, so every rank raises at
    the same one, never one alone while the others wait in a collective. Each rank's `bad` also includes
    non-finite gradients, which are identical on every rank after DDP's all-reduce, so a NaN that reaches the
    gradients skips the step on every rank alike. A loss that is non-finite on one rank with finite gradients
    everywhere (unusual) skips that rank's step alone until the next check point stops the run.

    Not checked: checkpoints saved with `save_weights_only=True` mid-epoch (Lightning calls no callback hook for
    them); BatchNorm running statistics updated by the forward passes of skipped batches.

    Args:
        check_every_n_steps: training batches between two host reads of the flag (the epoch's last batch and
            every checkpoint are checked as well).
    """

    def __init__(self, check_every_n_steps: int = 100) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self._bad: torch.Tensor | None = None

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        device = pl_module.device
        self._bad = torch.zeros((), dtype=torch.bool, device=device)  # sticky: any bad batch so far
        self._first = torch.full((), -1, dtype=torch.long, device=device)  # batch number of the first bad one
        self._kind = torch.zeros((), dtype=torch.long, device=device)  # its loss: see _KINDS
        self._n = torch.zeros((), dtype=torch.long, device=device)  # batch counter on the device
        self._n_host = 0  # the same counter on the host
        self._where: dict[int, tuple[int, int, int]] = {}  # batch number -> (global step, epoch, batch index)
        self._since_check = 0

    def on_train_batch_start(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch, batch_idx: int
    ) -> None:
        if self._bad is None:
            return
        self._n_host += 1
        self._n.add_(1)
        self._where[self._n_host] = (trainer.global_step, trainer.current_epoch, batch_idx)

    def on_before_backward(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", loss: torch.Tensor
    ) -> None:
        if self._bad is None:
            return
        loss = loss.detach().float().sum()  # a non-finite element keeps the sum non-finite
        kind = torch.where(
            torch.isnan(loss),
            3,
            torch.where(loss == float("inf"), 1, torch.where(loss == -float("inf"), 2, 0)),
        )
        self._mark(kind > 0, kind)

    def _mark(self, bad: torch.Tensor, kind: torch.Tensor) -> None:
        new = bad & ~self._bad
        self._first = torch.where(new, self._n, self._first)
        self._kind = torch.where(new, kind, self._kind)
        self._bad = self._bad | bad

    def on_before_optimizer_step(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", optimizer
    ) -> None:
        if self._bad is None:
            return
        if trainer.world_size > 1:
            # After DDP's all-reduce the gradients are the same on every rank: so is this part of the flag.
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                found = torch.zeros((), dtype=torch.float32, device=self._bad.device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones_like(found))
                self._mark(found > 0, torch.zeros_like(self._kind))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if getattr(optimizer, "_step_supports_amp_scaling", False) and scaler is None:
            optimizer.found_inf = self._bad.float()  # read by the fused kernel after this hook
        else:
            self._check(trainer)  # the fallback: one host read (and DDP all-reduce) per step

    def on_train_batch_end(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx: int
    ) -> None:
        if self._bad is None:
            return
        self._since_check += 1
        if self._since_check >= self.check_every_n_steps or batch_idx + 1 >= trainer.num_training_batches:
            self._check(trainer)

    def on_save_checkpoint(self, trainer: "L.Trainer", pl_module: "L.LightningModule", checkpoint) -> None:
        self._check(trainer)  # before anything is written (every rank dumps the checkpoint)

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._check(trainer)

    def _check(self, trainer: "L.Trainer") -> None:
        """Read the flag on the host (all ranks agree under DDP); raise NonFiniteLossError if it is set."""
        if self._bad is None:
            return
        self._since_check = 0
        state = self._state()
        if trainer.world_size > 1:
            state = trainer.strategy.reduce(state, reduce_op="max")
        encoded = int(state.item())
        if not encoded:
            self._where = {
                n: w for n, w in self._where.items() if n >= self._n_host
            }  # keep the current batch
            return
        first, kind = self._n_host + 1 - encoded // 4, encoded % 4
        step, epoch, batch_idx = self._where.get(first, (trainer.global_step, trainer.current_epoch, -1))
        self._forget_found_inf(trainer)
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none written yet"
        what = (
            f"The training loss is {_KINDS[kind]}"
            if kind
            else "The gradients are not finite (the loss is finite on every rank)"
        )
        raise NonFiniteLossError(
            f"{what} at global step {step}, epoch {epoch}, batch {batch_idx}; training stopped, and no optimizer "
            f"step from that batch on changed the weights (last good checkpoint: {last}). Try a lower "
            "--model.init_args.optimizer.init_args.lr, a longer warmup "
            "(--model.init_args.scheduler.init_args.warmup_epochs), or --trainer.precision 32-true; to find the "
            "operation that produced it, rerun with --config configs/debug/detect_anomaly.yaml (slow)."
        )

    def _state(self) -> torch.Tensor:
        """The first bad batch and its loss kind in one number, 0 if none, larger for an earlier batch: every rank
        counts the same batches, so an all-reduce "max" gives every rank the earliest bad batch of any rank."""
        big = self._n_host + 1
        return torch.where(self._bad, (big - self._first) * 4 + self._kind, 0)

    def _forget_found_inf(self, trainer: "L.Trainer") -> None:
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf  # a later step outside this fit must not be skipped

    def on_exception(self, trainer: "L.Trainer", pl_module: "L.LightningModule", exception) -> None:
        self._forget_found_inf(trainer)

    def teardown(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._forget_found_inf(trainer)
            self._bad = None
