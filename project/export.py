"""`python -m project export --ckpt_path X`: model.onnx and model.pt2 (torch.export), each checked against eager
PyTorch, plus preprocessing.json."""

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn

from project.atomic import atomic_write, write_text_atomic
from project.checkpoint import read_checkpoint
from project.errors import ConfigError
from project.inference import load_model, preprocessing_of
from project.run_dir import checkpoint_run

TOLERANCE = 1e-4  # max abs logit difference accepted between an exported program and eager PyTorch


def export(
    ckpt_path: str,
    out_dir: str | None = None,
    opset: int = 18,
    allow_class: list[str] | str | None = None,
) -> Path:
    """Export a trained checkpoint for deployment and verify the exported programs.

    Args:
        ckpt_path: a checkpoint written by `make train`, e.g. runs/<run>/checkpoints/last.ckpt.
        out_dir: where to write the files; default <run dir>/export.
        opset: ONNX opset version.
        allow_class: classes or module prefixes (my_models.TinyMLP, my_models; a list: '[a, b]') the checkpoint may
            name besides project, torchvision.models, torch.nn and torch.optim: their code runs, trust it.
    """
    prep = preprocessing_of(checkpoint := read_checkpoint(ckpt_path), ckpt_path)
    model = load_model(checkpoint, ckpt_path, allow_class)
    out = Path(out_dir) if out_dir else (checkpoint_run(ckpt_path) or Path(".")) / "export"
    gen = torch.Generator().manual_seed(0)
    # N(0, 1): the range of normalised inputs; traced with batch 2, checked on others: the axis is dynamic
    inputs = {f"random batch of {n}": torch.randn(n, *prep.input_shape, generator=gen) for n in (1, 5, 64)}
    example = inputs["random batch of 5"][:2]
    try:
        batch = torch.export.Dim("batch", min=1, max=4096)
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
        names = {"input_names": ["images"], "output_names": ["logits"], "opset_version": opset}
        onnx = torch.onnx.export(program, (example,), **names, dynamo=True)
    except ImportError as err:
        raise ConfigError(f"ONNX export needs: pip install -e '.[export]' ({err}).") from err
    except Exception as err:  # noqa: BLE001 - its full text is pages of hints: the first line names the cause
        raise ConfigError(
            f"Exporting {type(model).__name__} failed ({type(err).__name__}: "
            f"{(str(err).strip().splitlines() or [''])[0][:200]}). Data-dependent Python control flow is the usual "
            "cause: rewrite it with torch.where / torch.cond, or deploy the checkpoint with PyTorch."
        ) from err
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "preprocessing.json", json.dumps(asdict(prep), indent=2) + "\n")
    with atomic_write(out / "model.pt2", "wb") as f:
        torch.export.save(program, f)
    with atomic_write(out / "model.onnx", "wb") as f:
        f.write(onnx.model_proto.SerializeToString())
    import onnxruntime as ort

    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_run = lambda x: torch.from_numpy(session.run(None, {"images": x.numpy()})[0])  # noqa: E731
    _check("ONNX (onnxruntime)", onnx_run, model, inputs)
    _check("model.pt2", torch.export.load(out / "model.pt2").module(), model, inputs)
    print(f"Exported to {out}/: model.onnx, model.pt2, preprocessing.json", flush=True)
    return out


def _check(name: str, run, model: nn.Module, inputs: dict[str, Tensor]) -> None:
    for label, x in inputs.items():
        with torch.no_grad():
            diff = (model(x) - run(x)).abs().max().item()
        print(f"  {name:<20} {label:<28} max abs diff {diff:.2e}", flush=True)
        if not diff <= TOLERANCE:  # `not <=` also catches NaN
            raise ConfigError(
                f"{name} output differs from eager PyTorch by {diff:.2e} (> {TOLERANCE:g}) on {label}. "
                "The exported program is not faithful: check the model for data-dependent control flow or "
                "train-mode layers."
            )


def main(args: list[str]) -> None:
    from jsonargparse import auto_cli

    auto_cli(export, args=args, prog="python -m project export", as_positional=False)
