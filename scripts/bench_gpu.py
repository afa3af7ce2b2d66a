"""`scripts/bench.py --gpu`: ResNet-18 on CIFAR-shaped synthetic data, template vs raw loop, bf16 + channels_last.

50,000 x 3 x 32 x 32 uint8 images live on the GPU (the in-memory loader, crop + flip augmentation); both
sides train torchvision's resnet18 with AdamW, warmup-cosine, bf16 autocast and channels_last, and evaluate
10,000 images per epoch. Sized for one GPU within 5 minutes. `--gpu-size 512` dry-runs it on CPU.

With and without compile: the eager pair (template, raw loop) runs `repeats` rounds (at least 2), then one
round of the compiled pair (the template's `compile: true`, `nn.Module.compile()` on the raw loop's model):
each compile of ResNet-18's forward and backward takes tens of seconds on a GPU, and the GPU check's bench
stage has 200 s. A compiled side's warm-up epoch holds its compile, reported as `compile_seconds` (its
warm-up epoch minus the eager one's). On the CPU dry-run the compiled arms run with dynamo disabled
(`compile_backend: "disabled (CPU dry-run)"`): the same code path, no inductor build (minutes on a small CPU).
"""

import contextlib
import statistics
import tempfile
import time

import lightning as L
import torch
from bench_loops import machine
from torch import nn
from torch.utils.data import DataLoader

from project.data.augment import augment_training_batch
from project.data.base import ImageData
from project.data.loaders import ResumableDataLoader, TensorImages, batched
from project.data.normalize import Normalize
from project.models import TorchvisionClassifier
from project.module import ClassificationModule
from project.schedule import warmup_cosine

BATCH, EPOCHS, LR = 512, 3, 2e-3


MEAN, STD = [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]
RECIPE = "crop_flip"  # CIFAR-10's augmentation, on both sides


def _bf16(device: torch.device) -> bool:
    """bf16 autocast on the GPU; the CPU dry-run stays fp32 (bf16 autocast was ~5x slower there and it measures nothing)."""
    return device.type == "cuda"


def _data(n: int, device: torch.device, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """The template's in-memory path: each split one tensor on the device, a batch one index_select."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n + n // 5, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (n + n // 5,), generator=g)
    bs = min(BATCH, n)
    images, labels = images.to(device), labels.to(device)
    train = ResumableDataLoader(TensorImages(images[:n], labels[:n]), bs, seed, collate_fn=batched)
    val = DataLoader(TensorImages(images[n:], labels[n:]), bs, collate_fn=batched)
    return train, val


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def raw(n: int, device: torch.device, compile: bool = False) -> dict:
    torch.manual_seed(0)
    train, val = _data(n, device)
    model = TorchvisionClassifier("resnet18", 10).to(device, memory_format=torch.channels_last)
    if compile:
        model.compile()  # as the template's `compile: true` does (ClassificationModule.setup)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.05)
    total = EPOCHS * len(train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, len(train), total))
    loss_fn, dtype = nn.CrossEntropyLoss(label_smoothing=0.1), torch.bfloat16
    starts = []
    normalize = Normalize(MEAN, STD).to(device)
    for epoch in range(EPOCHS):
        train.sampler.set_epoch(epoch)
        _sync(device)
        starts.append(time.perf_counter())
        model.train()
        for b, (x, y) in enumerate(train):  # the template's per-batch work (project/data/base.py)
            x = normalize(augment_training_batch(x, RECIPE, 0, epoch, b, 0))
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=_bf16(device)):
                loss = loss_fn(model(x.contiguous(memory_format=torch.channels_last)).float(), y)
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        correct = torch.zeros((), device=device)
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=_bf16(device)):
            for x, y in val:
                x = normalize(x)
                correct += (model(x.contiguous(memory_format=torch.channels_last)).argmax(1) == y).sum()
        float(correct)
    _sync(device)
    starts.append(time.perf_counter())
    return {
        "epoch_seconds": [b - a for a, b in zip(starts, starts[1:], strict=False)],
        "samples_per_epoch": len(train) * train.batch_size,
    }


class _Data(ImageData):
    def __init__(self, n: int, device: torch.device) -> None:
        super().__init__()
        self.loaders = _data(n, device)
        self.class_names, self.input_shape = [str(i) for i in range(10)], (3, 32, 32)
        self.mean, self.std, self.recipe = MEAN, STD, RECIPE

    def setup(self, stage: str | None = None) -> None:  # the loaders are made above
        pass

    def train_dataloader(self):
        return self.loaders[0]

    def val_dataloader(self):
        return self.loaders[1]


class _Clock(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        _sync(pl_module.device)
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        _sync(pl_module.device)
        self.starts.append(time.perf_counter())


def template(n: int, device: torch.device, compile: bool = False) -> dict:
    torch.manual_seed(0)
    data, clock = _Data(n, device), _Clock()
    module = ClassificationModule(
        TorchvisionClassifier("resnet18", 10),
        10,
        (3, 32, 32),
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.05),
        label_smoothing=0.1,
        channels_last=True,
        compile=compile,
    )
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        trainer = L.Trainer(
            accelerator=device.type,
            devices=1,
            precision="bf16-mixed" if _bf16(device) else "32-true",
            max_epochs=EPOCHS,
            default_root_dir=tmp,
            callbacks=[clock],
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=L.pytorch.loggers.CSVLogger(tmp),
            log_every_n_steps=50,
        )
        trainer.fit(module, datamodule=data)
    s = clock.starts
    return {
        "epoch_seconds": [b - a for a, b in zip(s, s[1:], strict=False)],
        "samples_per_epoch": len(data.loaders[0]) * data.loaders[0].batch_size,
    }


def _compile_context(device: torch.device):
    """Dynamo off on the CPU dry-run (see the module docstring); nothing changes on a GPU."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(disable=True)


def _sps(r: dict) -> float:
    steady = r["epoch_seconds"][1:]
    return r["samples_per_epoch"] * len(steady) / sum(steady)


def bench_gpu(n: int, repeats: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    sps = _sps

    t_runs, r_runs = [], []
    for i in range(max(2, repeats)):
        order = [(template, t_runs), (raw, r_runs)]
        for fn, sink in order if i % 2 == 0 else order[::-1]:
            sink.append(fn(n, device))
    ratios = [sps(t) / sps(r) for t, r in zip(t_runs, r_runs, strict=True)]
    with _compile_context(device):
        t_comp, r_comp = template(n, device, compile=True), raw(n, device, compile=True)
    warm_t, warm_r = (statistics.median(x["epoch_seconds"][0] for x in runs) for runs in (t_runs, r_runs))
    return {
        "machine": machine(),
        "gpu": {
            "images": n,
            "batch_size": BATCH,
            "epochs": EPOCHS,
            "precision": "bf16-mixed" if _bf16(device) else "32-true",
            "channels_last": True,
            "template_images_per_s": round(statistics.median(map(sps, t_runs)), 1),
            "raw_loop_images_per_s": round(statistics.median(map(sps, r_runs)), 1),
            "throughput_ratio": round(statistics.median(ratios), 4),
            "ratios": [round(r, 4) for r in ratios],
            "template_warmup_epoch_seconds": round(warm_t, 3),
            "raw_warmup_epoch_seconds": round(warm_r, 3),
            # One round, after the eager ones (module docstring): compiled images/s and their ratios.
            "compile_backend": "inductor" if device.type == "cuda" else "disabled (CPU dry-run)",
            "compiled_template_images_per_s": round(sps(t_comp), 1),
            "compiled_raw_loop_images_per_s": round(sps(r_comp), 1),
            "compiled_throughput_ratio": round(sps(t_comp) / sps(r_comp), 4),
            "compile_speedup_template": round(sps(t_comp) / statistics.median(map(sps, t_runs)), 4),
            "compile_speedup_raw_loop": round(sps(r_comp) / statistics.median(map(sps, r_runs)), 4),
            "compile_seconds_template": round(t_comp["epoch_seconds"][0] - warm_t, 3),
            "compile_seconds_raw_loop": round(r_comp["epoch_seconds"][0] - warm_r, 3),
        },
    }
