"""`python -m project predict --ckpt_path X --input <image or folder>`: class predictions as a CSV. Not
LightningCLI's `predict` (a config, a Trainer, a predict dataloader): all it reads is in the checkpoint."""

import csv
import sys
from pathlib import Path

import torch
from PIL import Image

from project.atomic import atomic_write
from project.checkpoint import read_checkpoint
from project.errors import ConfigError
from project.inference import load_model, preprocessing_of
from project.run_dir import checkpoint_run


def predict(
    ckpt_path: str,
    input: str,
    output: str | None = None,
    top_k: int = 3,
    batch_size: int = 64,
    device: str = "auto",
    allow_class: list[str] | str | None = None,
) -> Path:
    """Classify an image file, or every file under a folder (recursively), with a trained checkpoint.

    Args:
        ckpt_path: a checkpoint written by `make train`, e.g. runs/<run>/checkpoints/last.ckpt.
        input: an image file, or a folder of images (searched recursively); unreadable files are skipped and listed.
        output: the CSV to write; default predictions.csv in the checkpoint's run directory.
        top_k: how many (class, probability) pairs to list per image.
        batch_size: images per forward pass.
        device: auto (CUDA when available), cpu or cuda.
        allow_class: classes or module prefixes (my_models.TinyMLP, my_models; a list: '[a, b]') the checkpoint may
            name besides project, torchvision.models, torch.nn and torch.optim: their code runs, trust it.
    """
    source = Path(input)
    if not source.exists():
        raise ConfigError(f"--input '{input}' does not exist. Pass an image file or a folder (INPUT=...).")
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    prep = preprocessing_of(checkpoint := read_checkpoint(ckpt_path), ckpt_path)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    model = load_model(checkpoint, ckpt_path, allow_class).to(device)
    k = max(1, min(top_k, len(prep.class_names)))
    rows, skipped = [], []
    for start in range(0, len(files), batch_size):
        batch, paths = [], []
        for f in files[start : start + batch_size]:
            try:
                with Image.open(f) as im:
                    batch.append(prep.image(im))
                paths.append(f)
            except (OSError, ValueError) as err:  # not an image (UnidentifiedImageError), truncated
                skipped.append(f"  {f}  ({type(err).__name__}: {err})")
        if batch:
            with torch.inference_mode():
                probs = model(torch.stack(batch).to(device)).float().softmax(dim=-1).cpu()
            for f, ps, idx in zip(paths, *(t.tolist() for t in probs.topk(k, dim=-1)), strict=True):
                top = ";".join(f"{prep.class_names[i]}:{p:.4f}" for i, p in zip(idx, ps, strict=True))
                rows.append([str(f), prep.class_names[idx[0]], f"{ps[0]:.6f}", top])
    out = Path(output) if output else (checkpoint_run(ckpt_path) or Path(".")) / "predictions.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out, "w", newline="") as fh:
        csv.writer(fh).writerows([["path", "class", "probability", f"top{k}"], *rows])
    print(f"Predicted {len(rows)} image(s) -> {out}", flush=True)
    if skipped:
        print(f"Skipped {len(skipped)} file(s), not readable images:", *skipped, sep="\n", file=sys.stderr)
    if not rows:
        raise ConfigError(f"No readable image under '{input}': nothing predicted. Point INPUT at images.")
    return out


def main(args: list[str]) -> None:
    from jsonargparse import auto_cli

    auto_cli(predict, args=args, prog="python -m project predict", as_positional=False)
