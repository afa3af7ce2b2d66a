"""`python -m project export --ckpt_path X`: model.onnx and model.pt2 (torch.export), each checked against eager
PyTorch on random inputs and real test batches (those rebuild the run's data module, which imports Lightning;
--check_batches 0 skips them), plus preprocessing.json."""

import json
from dataclasses import asdict
from pathlib import Path

import torch
import yaml
from torch import Tensor, nn

from project.atomic import atomic_write, write_text_atomic
from project.checkpoint import check_class_paths, read_checkpoint
from project.errors import ConfigError
from project.inference import load_model, preprocessing_of
from project.run_dir import checkpoint_run

TOLERANCE = 1e-4  # max abs logit difference accepted between an exported program and eager PyTorch


def export(
    ckpt_path: str,
    out_dir: str | None = None,
    opset: int = 18,
    check_batches: int = 1,
    allow_class: list[str] | str | None = None,
) -> Path:
    """Export a trained checkpoint for deployment and verify the exported programs.

    Args:
        ckpt_path: a checkpoint written by `make train`, e.g. runs/<run>/checkpoints/last.ckpt.
        out_dir: where to write the files; default <run dir>/export.
        opset: ONNX opset version.
        check_batches: how many test-split batches (real inputs) to compare on, besides random inputs.
        allow_class: classes or module prefixes (my_models.TinyMLP, my_models; a list: '[a, b]') the checkpoint may
            name besides project, torchvision.models, torch.nn and torch.optim: their code runs, trust it.
    """
    checkpoint = read_checkpoint(ckpt_path)
    prep = preprocessing_of(checkpoint, ckpt_path)
    model = load_model(checkpoint, ckpt_path, allow_class)
    data = _data_hparams(checkpoint, ckpt_path)
    check_class_paths(data, allow_class, ckpt_path, dotted_strings=True)  # before anything is written
    out = Path(out_dir) if out_dir else (checkpoint_run(ckpt_path) or Path(".")) / "export"
    gen = torch.Generator().manual_seed(0)
    inputs = {f"random batch of {n}": torch.randn(n, *prep.input_shape, generator=gen) for n in (1, 5)}
    inputs |= _real_batches(data, check_batches)
    example = inputs["random batch of 5"][:2]  # traced with batch 2, checked on others: the axis is dynamic
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
    _check(
        "ONNX (onnxruntime)",
        lambda x: torch.from_numpy(session.run(None, {"images": x.numpy()})[0]),
        model,
        inputs,
    )
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


def _data_hparams(checkpoint: dict, ckpt_path: str) -> dict:
    """The data module's saved hyperparameters, or else the data section of its run's config.yaml."""
    hparams = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    run = checkpoint_run(ckpt_path)
    if "_class_path" not in hparams and run is not None and (run / "config.yaml").is_file():
        data = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("data") or {}
        if "class_path" in data:
            hparams = {"_class_path": data["class_path"], **(data.get("init_args") or {})}
    return hparams


def _real_batches(hparams: dict, n: int) -> dict[str, Tensor]:
    """Up to n batches of the run's test split as the model sees them in training (class paths checked already)."""
    if n <= 0:
        return {}
    if "_class_path" not in hparams:
        print("  (no real inputs: neither the checkpoint nor a runs/<run>/config.yaml names the data module)")
        return {}
    import lightning as L
    from lightning.pytorch.cli import instantiate_module

    try:
        data = instantiate_module(L.LightningDataModule, hparams)
        data.setup("test")
        loader = data.test_dataloader()
    except Exception as err:  # noqa: BLE001 - the data may live elsewhere; random inputs still check
        print(f"  (no real inputs: the training data is not available here: {err})", flush=True)
        return {}
    batches = {}
    for i, batch in zip(range(n), loader):
        x, _ = data.on_after_batch_transfer(batch, 0)  # ImageFolder batches are normalised in this hook
        batches[f"test batch {i} ({len(x)} images)"] = x
    return batches


def main(args: list[str]) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="python -m project export", description=export.__doc__.splitlines()[0])
    parser.add_function_arguments(export, as_group=False)
    export(**parser.parse_args(args).as_dict())
