"""`python -m project export --ckpt_path X`: ONNX + torch.export programs, each checked against eager PyTorch.

Writes into <out_dir>: model.onnx (dynamic batch axis), model.pt2 (torch.export; model.ts TorchScript when
torch.export cannot trace the model; model.onnx then comes from that trace) and preprocessing.json (class
names, input shape, normalisation).

The model is rebuilt without Lightning (project/inference.py). The real test batches of the check come from the
run's own data module, a LightningDataModule rebuilt from the hyperparameters it saved or else from its run's
config.yaml, so that step (on by default, --check_batches 0 skips it) imports Lightning; its class paths pass the
same allowlist first.
"""

import json
import warnings
from pathlib import Path

import torch
import yaml
from torch import Tensor, nn

from project.atomic import atomic_path, atomic_write, write_text_atomic
from project.checkpoint import allowed, check_class_paths, read_checkpoint
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
        allow_class: a class (my_models.TinyMLP) or module prefix (my_models), or a list of them ('[a, b]'), that
            the checkpoint may name besides project.*, torchvision.models.*, torch.nn.* and torch.optim.*.
            Rebuilding the model imports the modules its hyperparameters name: allow only code you trust.
    """
    allow = allowed(allow_class)
    checkpoint = read_checkpoint(ckpt_path)
    prep = preprocessing_of(checkpoint, ckpt_path)
    # The bare nn.Module, in eval mode: dropout off and BatchNorm on running statistics in the exported graph.
    model = load_model(checkpoint, ckpt_path, allow)
    data_hparams = _data_hparams(checkpoint, ckpt_path)
    check_class_paths(data_hparams, allow, ckpt_path, dotted_strings=True)  # before anything is written
    out = Path(out_dir) if out_dir else (checkpoint_run(ckpt_path) or Path(".")) / "export"
    out.mkdir(parents=True, exist_ok=True)

    gen = torch.Generator().manual_seed(0)
    inputs = {"random batch of 1": torch.randn(1, *prep.input_shape, generator=gen)}
    inputs["random batch of 5"] = torch.randn(5, *prep.input_shape, generator=gen)
    inputs.update(_real_batches(data_hparams, check_batches))
    example = inputs["random batch of 5"][
        :2
    ]  # traced with batch 2; checked with 1, 5 and 64: the axis is dynamic

    write_text_atomic(out / "preprocessing.json", json.dumps(prep.to_json(), indent=2) + "\n")
    # One torch.export trace serves both formats: model.pt2, and the ONNX conversion of the same program.
    program_path, runner, program = _export_program(model, example, out)
    # If torch.export failed, the ONNX exporter (built on it) would too: ONNX then comes from the trace.
    onnx_path = _export_onnx(program if program is not None else runner, example, out / "model.onnx", opset)
    _check("ONNX (onnxruntime)", _onnx_runner(onnx_path), model, inputs)
    _check(program_path.name, runner, model, inputs)
    print(f"Exported to {out}/: {onnx_path.name}, {program_path.name}, preprocessing.json", flush=True)
    return out


def _export_onnx(source, example: Tensor, path: Path, opset: int) -> Path:
    """ONNX from the ExportedProgram (dynamo exporter, needs onnxscript), or from the TorchScript fallback."""
    names = {"input_names": ["images"], "output_names": ["logits"], "opset_version": opset}
    try:
        if isinstance(source, torch.export.ExportedProgram):  # carries its dynamic batch already
            with atomic_path(path) as tmp:
                torch.onnx.export(source, (example,), str(tmp), **names, dynamo=True, external_data=False)
        else:  # a traced ScriptModule: torch's TorchScript exporter (deprecated, but the only route left)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                batch = {"images": {0: "batch"}, "logits": {0: "batch"}}
                with atomic_path(path) as tmp:
                    torch.onnx.export(source, (example,), str(tmp), **names, dynamic_axes=batch, dynamo=False)
    except ImportError as err:
        raise ConfigError(
            f"ONNX export needs the export extras: pip install -e '.[export]' ({err})."
        ) from err
    return path


def _onnx_runner(path: Path):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def _export_program(model: nn.Module, example: Tensor, out: Path):
    """torch.export with a dynamic batch; TorchScript tracing when torch.export fails on this model."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
        path = out / "model.pt2"
        with atomic_write(path, "wb") as f:
            torch.export.save(program, f)
        return path, torch.export.load(path).module(), program
    except Exception as err:  # noqa: BLE001 - any tracing failure means: fall back
        first = (str(err).strip().splitlines() or [""])[0][:200]  # its full text is pages of hints
        print(
            f"torch.export failed ({type(err).__name__}: {first}); falling back to TorchScript.", flush=True
        )
        path = out / "model.ts"
        with torch.no_grad():
            traced = torch.jit.trace(model, example)
        with atomic_write(path, "wb") as f:
            torch.jit.save(traced, f)
        return path, torch.jit.load(str(path)), None


def _check(name: str, run, model: nn.Module, inputs: dict[str, Tensor]) -> None:
    for label, x in inputs.items():
        with torch.no_grad():
            expected, got = model(x), run(x)
        diff = (expected - got).abs().max().item()
        print(f"  {name:<20} {label:<28} max abs diff {diff:.2e}", flush=True)
        if not diff <= TOLERANCE:  # `not <=` also catches NaN
            raise ConfigError(
                f"{name} output differs from eager PyTorch by {diff:.2e} (> {TOLERANCE:g}) on {label}. "
                "The exported program is not faithful: check the model for data-dependent control flow or "
                "train-mode layers."
            )


def _data_hparams(checkpoint: dict, ckpt_path: str) -> dict:
    """How to rebuild the run's data module: the hyperparameters it saved (save_hyperparameters()), or for a data
    module that saves none the data section of its run's config.yaml (LightningCLI writes one for every run)."""
    hparams = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    run = checkpoint_run(ckpt_path)
    if "_class_path" not in hparams and run is not None and (run / "config.yaml").is_file():
        data = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("data") or {}
        if "class_path" in data:
            hparams = {"_class_path": data["class_path"], **(data.get("init_args") or {})}
    return hparams


def _real_batches(hparams: dict, n: int) -> dict[str, Tensor]:
    """Up to n batches of the run's test split, rebuilt from the saved data hyperparameters (already checked
    against the allowlist)."""
    if n > 0 and "_class_path" not in hparams:
        print(
            "  (no real inputs: neither the checkpoint (its data module's save_hyperparameters()) nor a "
            "runs/<run>/config.yaml above it says how to rebuild the data module)",
            flush=True,
        )
    if n <= 0 or "_class_path" not in hparams:
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
    for i, batch in enumerate(loader):
        if i >= n:
            break
        # what the model sees in training: ImageFolder batches are normalised in this hook (normalize.py)
        x, _ = data.on_after_batch_transfer(batch, 0)
        batches[f"test batch {i} ({len(x)} images)"] = x
    return batches


def main(args: list[str]) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="python -m project export", description=export.__doc__.splitlines()[0])
    parser.add_function_arguments(export, as_group=False)
    export(**parser.parse_args(args).as_dict())
