"""What scripts/gpu_check.py plugs into `python3 -m project fit` runs: a probe callback and a model.

Both are reached by class_path (`gpu_check_probes.Probe`, `gpu_check_probes.AdaptivePoolNet`); the check puts
scripts/ on PYTHONPATH. Nothing here is part of the template.
"""

import json
import time
import traceback
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

SYNC_WARNING = "synchronizing CUDA operation"  # the text of torch's sync-debug warning ("called a ...")


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


class Probe(L.Callback):
    """Records where the run trained (device, precision, loader, process group) and its peak GPU memory, and
    watches a window of steady-state training steps for host syncs.

    The window: `window_steps` training steps of epoch `window_epoch` from batch `window_start` on (the first steps
    of a run and of an epoch are not steady state: cuDNN autotuning, allocator growth, the loader's epoch start).
    Inside it `torch.cuda.set_sync_debug_mode("warn")` is on: torch reports each synchronizing CUDA call (`.item()`,
    a device-to-host copy, `nonzero`, a non-blocking copy from pageable memory...). "warn" and "error" are the
    same detector; "error" stops at the first sync and takes the fit down with it, "warn" lists every sync of the
    window with the step, the Python stack and whether Lightning logs at that step (`log_every_n_steps`: a
    periodic read there is allowed), and the fit goes on. A canary, one `.item()` on the GPU when the window
    opens, must be caught: a check that cannot see a known sync proves nothing. Without CUDA (the dry-run) the
    window opens and closes the same way and reports `detector: "none (no CUDA)"`.

    Writes `<out>/<name>.json` at the end of fit and, when the window closes, `<out>/sync_debug.json`.
    """

    def __init__(
        self,
        out: str,
        name: str = "fit_probe",
        window_epoch: int = 1,
        window_start: int = 2,
        window_steps: int = 0,
    ) -> None:
        self.out, self.name = Path(out), name
        self.window_epoch, self.window_start, self.window_steps = window_epoch, window_start, window_steps
        self.info: dict = {}
        self.syncs: list[dict] = []
        self._saved = None
        self._window_done = False

    # -- where the run trains ------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.info:
            x = batch[0] if isinstance(batch, list | tuple) else batch
            dist = torch.distributed
            self.info = {
                "device": str(pl_module.device),
                "device_name": torch.cuda.get_device_name(pl_module.device)
                if pl_module.device.type == "cuda"
                else "cpu",
                "batch_device": str(x.device),
                "batch_on_training_device": x.device == pl_module.device,
                "train_loader": type(trainer.train_dataloader).__qualname__,
                "precision": trainer.precision,
                "strategy": type(trainer.strategy).__name__,
                "process_group_backend": dist.get_backend()
                if dist.is_available() and dist.is_initialized()
                else None,
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
        cuda = pl_module.device.type == "cuda"
        mib = 2**20
        self.info |= {
            "global_step": trainer.global_step,
            "peak_gpu_memory_allocated_mib": round(torch.cuda.max_memory_allocated(pl_module.device) / mib, 1)
            if cuda
            else None,
            "peak_gpu_memory_reserved_mib": round(torch.cuda.max_memory_reserved(pl_module.device) / mib, 1)
            if cuda
            else None,
        }
        if trainer.is_global_zero:
            _write(self.out / f"{self.name}.json", self.info)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._saved is not None:
            self._close_window(trainer, error="".join(traceback.format_exception(exception))[-4000:])

    # -- the sync window -----------------------------------------------------------------------------------------
    def _in_window_start(self, trainer, batch_idx: int) -> bool:
        return (
            self.window_steps > 0
            and not self._window_done
            and trainer.current_epoch == self.window_epoch
            and batch_idx == self.window_start
        )

    def _open_window(self, trainer, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._first_step = None
        self._steps: list[dict] = []
        self._saved = (warnings.filters[:], warnings.showwarning)
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        previous = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                stack = traceback.format_stack(limit=12)[:-1]
                step = trainer.global_step
                self.syncs.append(
                    {
                        "global_step": step,
                        "message": str(message),
                        "where": f"{filename}:{lineno}",
                        "stack": stack,
                    }
                )
            else:
                previous(message, category, filename, lineno, file, line)

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
        log_every = trainer.log_every_n_steps
        syncs = self.syncs
        # Lightning logs when the count of steps taken reaches a multiple of log_every_n_steps: at or just before
        # the optimizer step that completes it (both sides allowed).
        for s in syncs:
            s["logging_step"] = s["global_step"] % log_every == 0 or (s["global_step"] + 1) % log_every == 0
        unexpected = [s for s in syncs if not s["logging_step"]]
        report = {
            "detector": "torch.cuda.set_sync_debug_mode('warn')" if self._cuda else "none (no CUDA)",
            "canary_caught": self.canary_caught,
            "window": {
                "epoch": self.window_epoch,
                "first_batch": self.window_start,
                "steps": self.window_steps,
                "ended_at_global_step": trainer.global_step,
                "seconds": round(time.perf_counter() - self._opened, 3),
            },
            "log_every_n_steps": log_every,
            "syncs": syncs,
            "syncs_outside_logging_steps": len(unexpected),
            "passed": error is None and not unexpected and self.canary_caught is not False,
        }
        if error:
            report["error"] = error
        if trainer.is_global_zero:
            _write(self.out / "sync_debug.json", report)


class _PoolBackwardAlert(torch.autograd.Function):
    """adaptive_avg_pool2d whose backward, off CUDA, raises torch's own alert for the CUDA kernel (dry-run)."""

    @staticmethod
    def forward(ctx, x, size):
        ctx.save_for_backward(x)
        ctx.size = size
        return F.adaptive_avg_pool2d(x, size)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        from torch._prims_common import alert_not_deterministic  # the same message as the CUDA kernel's

        alert_not_deterministic("adaptive_avg_pool2d_backward_cuda")
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (g,) = torch.autograd.grad(F.adaptive_avg_pool2d(x, ctx.size), x, grad)
        return g, None


class AdaptivePoolNet(nn.Module):
    """A conv, then `AdaptiveAvgPool2d(7)` as in torchvision's VGG, then a linear head.

    On CUDA, AdaptiveAvgPool2d's backward has no deterministic kernel (atomicAdd): under the default
    `deterministic: true` torch raises "adaptive_avg_pool2d_backward_cuda does not have a deterministic
    implementation...". The CPU kernel is deterministic, so off CUDA (the dry-run) the backward raises the same
    alert through torch's Python helper.
    """

    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1)
        self.head = nn.Linear(width * 49, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        x = F.adaptive_avg_pool2d(x, 7) if x.is_cuda else _PoolBackwardAlert.apply(x, 7)
        return self.head(x.flatten(1))
