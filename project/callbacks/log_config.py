"""LogConfig: config.yaml without secrets, the config in every logger, and TensorBoard's HPARAMS record."""

import re
from pathlib import Path

import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from project.callbacks.run_checkpoint import staged
from project.callbacks.run_summary import selected

# Keys whose values never reach config.yaml or a logger (NeptuneLogger's or CometLogger's api_key, ...).
SECRET_KEY = re.compile(r"(api_?key|token|secret|password|passwd|credential)", re.IGNORECASE)
REDACTED = "<redacted: set it through the environment>"
LR_KEYS = (("model", "init_args", "optimizer", "init_args", "lr"), ("model", "init_args", "lr"))


def redact(value):
    """A copy of a config (Namespace, dict, list) with the values of secret-looking keys replaced."""
    if isinstance(value, Namespace):
        return Namespace(**redact(vars(value)))
    if isinstance(value, dict):
        secret = {k for k, v in value.items() if v is not None and SECRET_KEY.search(str(k))}
        return {k: REDACTED if k in secret else redact(v) for k, v in value.items()}
    return [redact(v) for v in value] if isinstance(value, list) else value


class LogConfig(SaveConfigCallback):
    """LightningCLI's config saver (its `save_config_callback`), without secrets and visible in the loggers.

    At setup every logger gets config.yaml (read back: a second dump would add to every start) and the parameter
    counts. After test (or fit when no test follows) `key_hyperparameters` go to W&B's config and TensorBoard's
    HPARAMS record (its first is kept) with `best/<monitor>`, `best/val_acc` and every test/* metric: written as
    TensorBoardLogger.log_hyperparams(params, metrics) would, without that call's logging every metric again.
    """

    test_follows_fit = False
    _best: dict = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved:
            self.config = redact(self.config)
            self._path = Path(trainer.log_dir) / self.config_filename  # every rank: log_dir broadcasts
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        config = yaml.safe_load(self._path.read_text())  # as in config.yaml: plain values for every logger
        sizes = [(p.numel(), p.requires_grad) for p in pl_module.parameters()]
        params = {"total": sum(n for n, _ in sizes), "trainable": sum(n for n, trained in sizes if trained)}
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": config, "params": params})

    def on_fit_end(self, trainer, pl_module) -> None:
        best, self._best = selected(trainer), {}
        if best["best_score"] is not None:  # the monitor's best, and that epoch's val/acc
            self._best[f"best/{best['monitor'].replace('/', '_')}"] = best["best_score"]
            if best["best_val_acc"] is not None:
                self._best["best/val_acc"] = best["best_val_acc"]
        for logger in trainer.loggers if trainer.is_global_zero and self._best else []:
            if isinstance(logger, TensorBoardLogger):  # the scalars HPARAMS reads its values from
                logger.log_metrics(self._best, step=trainer.global_step)
            elif isinstance(logger, WandbLogger):
                logger.experiment.summary.update(self._best)
        if not (self.test_follows_fit and not trainer.interrupted):  # as ProjectCLI.after_fit decides
            self._log_key_hyperparameters(trainer, pl_module, self._best)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        # Logged with the test metrics, `step` replaces Lightning's `epoch`; collective, as DDP expects.
        pl_module.log("step", float(trainer.global_step), sync_dist=True, reduce_fx="max")

    def on_test_end(self, trainer, pl_module) -> None:
        tested = {k: float(v) for k, v in trainer.callback_metrics.items() if staged(k, "test")}
        self._log_key_hyperparameters(trainer, pl_module, {**self._best, **tested})

    def _log_key_hyperparameters(self, trainer, pl_module, metrics: dict) -> None:
        path = getattr(self, "_path", None)
        if trainer.is_global_zero and path is not None and path.is_file():
            params = key_hyperparameters(yaml.safe_load(path.read_text()), trainer, pl_module)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    _write_hparams(logger.experiment, params, metrics, trainer.global_step)
                elif isinstance(logger, WandbLogger):
                    logger.log_hyperparams(params)


def _write_hparams(experiment, params: dict, metrics: dict, step: int) -> None:
    """The HPARAMS record into the run's folder (SummaryWriter.add_hparams writes a sub-folder: a second run): into
    the event file the writer has open, or a new one beside it when Lightning closed it at fit end."""
    from torch.utils.tensorboard import FileWriter
    from torch.utils.tensorboard.summary import hparams

    writer = experiment.file_writer or FileWriter(experiment.get_logdir())
    for record in hparams(params, metrics):
        writer.add_summary(record, step)
    if writer is experiment.file_writer:
        writer.flush()
    else:
        writer.close()


def key_hyperparameters(config: dict, trainer, pl_module) -> dict:
    """The hyperparameters runs are compared by, under short names (TensorBoard's hparams take plain values)."""
    net = getattr(pl_module, "model", None)
    optimizer = (getattr(trainer, "optimizers", None) or [None])[0]
    lrs = [_get(config, *keys) for keys in LR_KEYS] + [getattr(optimizer, "defaults", {}).get("lr")]
    key = {
        "model": type(net if net is not None else pl_module).__name__,
        "lr": next((lr for lr in lrs if lr is not None), None),
        "batch_size": _get(config, "data", "init_args", "batch_size"),
        "max_epochs": trainer.max_epochs,
        "seed": config.get("seed_everything"),
        "precision": str(trainer.precision),
        "devices": trainer.num_devices,
        "nodes": trainer.num_nodes,
    }
    return {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in key.items()}


def _get(config, *keys):
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config
