"""What scripts/gpu_check.py plugs into its `python3 -m project fit` runs by class_path: a probe and a model."""

import json
import time
import traceback
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

SYNC_WARNING = "synchronizing CUDA operation"  # torch's sync-debug warning ("called a ...")


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


class Probe(L.Callback):
    """Where the run trained (device, precision, loader, process group), its peak GPU memory (`<out>/<name>.json`),
    and host syncs in `window_steps` steady-state steps of epoch `window_epoch` from batch `window_start` on
    (`<out>/sync_debug.json`; a run's and an epoch's first steps autotune and grow the allocator).

    In the window torch's `set_sync_debug_mode("warn")` reports every synchronizing CUDA call, recorded with its
    step and stack; one at a step where Lightning logs (`log_every_n_steps`) is allowed. "error" would stop the
    fit at the first. A canary `.item()` must be caught: a detector that misses a known sync proves nothing.
    """

    def __init__(self, out: str, name: str = "fit_probe", window_epoch: int = 1, window_start: int = 2,
                 window_steps: int = 0) -> None:  # fmt: skip
        self.out, self.name = Path(out), name
        self.window_epoch, self.window_start, self.window_steps = window_epoch, window_start, window_steps
        self.info: dict = {}
        self.syncs: list[dict] = []
        self._saved, self._window_done = None, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.info:
            x = batch[0] if isinstance(batch, list | tuple) else batch
            device, dist = pl_module.device, torch.distributed
            self.info = {
                "device": str(device),
                "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "batch_device": str(x.device),
                "batch_on_training_device": x.device == device,
                "train_loader": type(trainer.train_dataloader).__qualname__,
                # the in-memory path holds the training split as one tensor on the training device
                "train_data_on_device": getattr(trainer.train_dataloader.dataset, "labels", x).device
                == x.device,
                "precision": trainer.precision,
                "strategy": type(trainer.strategy).__name__,
                "process_group_backend": dist.get_backend() if dist.is_initialized() else None,
                "world_size": trainer.world_size,
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "cudnn_benchmark": torch.backends.cudnn.benchmark,
            }
        if self._in_window_start(trainer, batch_idx):
            self._open_window(trainer, pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._saved is not None and batch_idx >= self.window_start + self.window_steps - 1:
            self._close_window(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._saved is not None:  # an epoch shorter than the window
            self._close_window(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        cuda, mib = pl_module.device.type == "cuda", 2**20
        for key in ("allocated", "reserved"):
            fn = getattr(torch.cuda, f"max_memory_{key}")
            self.info[f"peak_gpu_memory_{key}_mib"] = round(fn(pl_module.device) / mib, 1) if cuda else None
        self.info["global_step"] = trainer.global_step
        if trainer.is_global_zero:
            _write(self.out / f"{self.name}.json", self.info)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._saved is not None:
            self._close_window(trainer, error="".join(traceback.format_exception(exception))[-4000:])

    def _in_window_start(self, trainer, batch_idx: int) -> bool:
        return (self.window_steps > 0 and not self._window_done and trainer.current_epoch == self.window_epoch
                and batch_idx == self.window_start)  # fmt: skip

    def _open_window(self, trainer, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._saved = (warnings.filters[:], warnings.showwarning)
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        previous = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING not in str(message):
                return previous(message, category, filename, lineno, file, line)
            stack = traceback.format_stack(limit=12)[:-1]
            self.syncs.append({"global_step": trainer.global_step, "message": str(message),
                               "where": f"{filename}:{lineno}", "stack": stack})  # fmt: skip

        warnings.showwarning = record
        self.canary_caught = None
        if self._cuda:
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("warn")
            torch.ones((), device=device).item()  # a known sync: the detector must report it
            self.canary_caught = len(self.syncs) == 1
            self.syncs.clear()
        self._opened = time.perf_counter()

    def _close_window(self, trainer, error: str | None = None) -> None:
        if self._cuda:
            torch.cuda.set_sync_debug_mode("default")
        warnings.filters[:], warnings.showwarning = self._saved
        self._saved, self._window_done = None, True
        every = trainer.log_every_n_steps
        for (
            s
        ) in self.syncs:  # Lightning logs at, or just before, the step that completes a multiple of `every`
            s["logging_step"] = s["global_step"] % every == 0 or (s["global_step"] + 1) % every == 0
        outside = sum(not s["logging_step"] for s in self.syncs)
        report = {
            "detector": "torch.cuda.set_sync_debug_mode('warn')" if self._cuda else "none (no CUDA)",
            "canary_caught": self.canary_caught,
            "window": {"epoch": self.window_epoch, "first_batch": self.window_start, "steps": self.window_steps,
                       "ended_at_global_step": trainer.global_step,
                       "seconds": round(time.perf_counter() - self._opened, 3)},
            "log_every_n_steps": every,
            "syncs": self.syncs,
            "syncs_outside_logging_steps": outside,
            "passed": error is None and not outside and self.canary_caught is not False,
        }  # fmt: skip
        if error:
            report["error"] = error
        if trainer.is_global_zero:
            _write(self.out / "sync_debug.json", report)


class _PoolBackwardAlert(torch.autograd.Function):
    """adaptive_avg_pool2d whose backward raises, off CUDA, torch's own alert for the CUDA kernel (the dry-run)."""

    @staticmethod
    def forward(ctx, x, size):
        ctx.save_for_backward(x)
        ctx.size = size
        return F.adaptive_avg_pool2d(x, size)

    @staticmethod
    def backward(ctx, grad):
        from torch._prims_common import alert_not_deterministic

        alert_not_deterministic("adaptive_avg_pool2d_backward_cuda")
        with torch.enable_grad():
            x = ctx.saved_tensors[0].detach().requires_grad_()
            return torch.autograd.grad(F.adaptive_avg_pool2d(x, ctx.size), x, grad)[0], None


class AdaptivePoolNet(nn.Module):
    """A conv, `AdaptiveAvgPool2d(7)` as in torchvision's VGG, a linear head. On CUDA that pool's backward has no
    deterministic kernel (atomicAdd), so `deterministic: true` raises; on CPU the same alert is raised by hand."""

    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1)
        self.head = nn.Linear(width * 49, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        x = F.adaptive_avg_pool2d(x, 7) if x.is_cuda else _PoolBackwardAlert.apply(x, 7)
        return self.head(x.flatten(1))
