"""LogConfig: saves config.yaml with secrets redacted, logs the config + parameter counts as hyperparameters, and
gives TensorBoard's HPARAMS tab and W&B's config the run's key hyperparameters with its final metrics."""

import re
from pathlib import Path

import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import SaveConfigCallback

from project.callbacks.run_checkpoint import staged
from project.callbacks.run_summary import selecting_checkpoint

# Keys whose values must never reach config.yaml or a logger (e.g. NeptuneLogger's or CometLogger's api_key).
SECRET_KEY = re.compile(r"(api_?key|token|secret|password|passwd|credential)", re.IGNORECASE)
REDACTED = "<redacted: set it through the environment>"
# Where this run writes, not how it trains: never a "changed" hyperparameter.
LOCATION_KEY = re.compile(r"(^|\.)(run_dir|ckpt_path|default_root_dir|save_dir|dirpath)$")
# The learning rate's config key: the optimizer's (a LightningCLI OptimizerCallable), or the module's own `lr`.
LR_KEYS = ("model.init_args.optimizer.init_args.lr", "model.init_args.lr")


def redact(value):
    """A copy of a config (Namespace/dict/list) with secret-looking keys' values replaced."""
    if isinstance(value, Namespace):
        return Namespace(**{k: REDACTED if _secret(k, v) else redact(v) for k, v in vars(value).items()})
    if isinstance(value, dict):
        return {k: REDACTED if _secret(k, v) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def _secret(key, value) -> bool:
    return isinstance(key, str) and SECRET_KEY.search(key) is not None and value is not None


class LogConfig(SaveConfigCallback):
    """LightningCLI's config saver (passed as `save_config_callback`), made safe and visible in the loggers.

    At setup, every logger gets config.yaml (as the parent class just wrote it, read back: dumping the config a
    second time for the loggers would add ~0.1 s to every start) and the parameter counts.

    After fit and after test, the run's key hyperparameters (`key_hyperparameters`: model class, lr, batch size,
    max_epochs, seed, precision, devices, nodes, and every config key that differs from the defaults, i.e.
    configs/default.yaml, under its dotted name) go to TensorBoard's HPARAMS tab with the run's final metrics:
    `best/<monitor>` (the selected checkpoint's monitored value, summary.json's `best_score`), `best/val_acc` (its
    val/acc, summary.json's `best_val_acc`) and every `test/*` (or `test_*`) metric. The same key set goes to W&B's
    config, the `best/*` values to the W&B run's summary. The test metrics themselves are logged at the last training step,
    without the `epoch` that Lightning otherwise adds (the epoch series would jump to max_epochs after training).

    The HPARAMS record is written with torch's `hparams` summaries, as Lightning's
    `TensorBoardLogger.log_hyperparams(params, metrics)` writes them, but not through it: that call also logs every
    metric again as a scalar, so the `test/*` values Lightning has logged would appear twice. The HPARAMS tab reads
    a metric's value from its scalar series, and only the first record of a run counts: it is written once, after
    test (or after fit when no test follows). A resumed run keeps the first session's record.
    """

    test_follows_fit = False  # set by the CLI when trainer.test runs right after this fit (as RunReport's)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved:
            self.config = redact(self.config)
            self._path = Path(trainer.log_dir) / self.config_filename  # every rank: log_dir broadcasts
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        params = list(pl_module.parameters())
        hparams = {
            # Through YAML, as in config.yaml: plain values (no Path objects) that every logger can store.
            "config": yaml.safe_load(self._path.read_text()),
            "params": {
                "total": sum(p.numel() for p in params),
                "trainable": sum(p.numel() for p in params if p.requires_grad),
            },
        }
        for logger in trainer.loggers:
            logger.log_hyperparams(hparams)

    # -- key hyperparameters with the final metrics ----------------------------------------------------------
    def on_fit_end(self, trainer, pl_module) -> None:
        self._best = best_metrics(trainer)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                _log_best(logger, self._best, trainer.global_step)
        # One record per run: TensorBoard keeps the first it reads of a run (it is the series' metadata), so when
        # the CLI tests next (the condition of ProjectCLI.after_fit), the record waits for the test metrics.
        if not (self.test_follows_fit and not trainer.interrupted):
            self._log_key_hyperparameters(trainer, pl_module, self._best)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        # Lightning logs `epoch` (max_epochs after a fit) with the test metrics unless a `step` is logged with them.
        # The maximum over ranks of equal values: exact, and collective as Lightning expects under DDP.
        pl_module.log("step", float(trainer.global_step), sync_dist=True, reduce_fx="max")

    def on_test_end(self, trainer, pl_module) -> None:
        tested = {k: float(v) for k, v in trainer.callback_metrics.items() if staged(k, "test")}
        self._log_key_hyperparameters(trainer, pl_module, {**getattr(self, "_best", {}), **tested})

    def _log_key_hyperparameters(self, trainer, pl_module, metrics: dict) -> None:
        """The HPARAMS record: the key hyperparameters, naming `metrics` (already logged as scalar series)."""
        if not trainer.is_global_zero or getattr(self, "_path", None) is None or not self._path.is_file():
            return
        from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

        params = key_hyperparameters(
            yaml.safe_load(self._path.read_text()), self._defaults(), trainer, pl_module
        )
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                _write_hparams(logger.experiment, params, metrics, trainer.global_step)
            elif isinstance(logger, WandbLogger):
                logger.log_hyperparams(params)

    def _defaults(self) -> dict:
        """The config of `python -m project fit` without flags (configs/default.yaml), dumped as config.yaml is."""
        if getattr(self, "_default_config", None) is None:
            try:
                # unvalidated: this run's parser has only the links of its own module class, which may not be
                # the default config's (configs/autoencoder.yaml)
                defaults = self.parser.get_defaults(skip_validation=True)
                dump = self.parser.dump(defaults, skip_none=False, skip_validation=True)
                self._default_config = redact(yaml.safe_load(dump))
            except Exception as err:  # a finished run must not fail over a column of the HPARAMS table
                from lightning.pytorch.utilities import rank_zero_warn

                rank_zero_warn(
                    f"HPARAMS: the default config could not be read ({err}); no changed keys are listed."
                )
                self._default_config = {}
        return self._default_config


def _write_hparams(experiment, params: dict, metrics: dict, step: int) -> None:
    """The HPARAMS record into the run's own folder, beside its scalars (SummaryWriter.add_hparams would write a
    sub-folder, a second run, with the metrics logged again): into the event file the SummaryWriter has open (its
    public `file_writer`), or a new one in the same folder when it has none open (Lightning closes it at fit end)."""
    from torch.utils.tensorboard import FileWriter
    from torch.utils.tensorboard.summary import hparams

    writer = experiment.file_writer
    own = writer is None
    if own:
        writer = FileWriter(experiment.get_logdir())
    for record in hparams(params, metrics):
        writer.add_summary(record, step)
    if own:
        writer.close()
    else:
        writer.flush()


def _log_best(logger, best: dict, step: int) -> None:
    """The best/* values: TensorBoard scalars (what HPARAMS shows), the W&B run's summary."""
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    if isinstance(logger, TensorBoardLogger) and best:
        logger.log_metrics(best, step=step)
    elif isinstance(logger, WandbLogger) and best:
        logger.experiment.summary.update(best)


def best_metrics(trainer) -> dict[str, float]:
    """The selected checkpoint's monitored value (`best/<monitor>`) and val/acc (`best/val_acc`, when the
    checkpoint callback records it: project.callbacks.RunCheckpoint), as summary.json reports them."""
    ckpt = selecting_checkpoint(trainer)
    if ckpt is None or ckpt.best_model_score is None:
        return {}
    best = {f"best/{ckpt.monitor.replace('/', '_')}": float(ckpt.best_model_score)}
    if (val_acc := getattr(ckpt, "best_model_metrics", {}).get("val/acc")) is not None:
        best["best/val_acc"] = float(val_acc)
    return best


def key_hyperparameters(config: dict, defaults: dict, trainer, pl_module) -> dict:
    """The hyperparameters to compare runs by: plain values (str, int, float, bool) under short names, then every
    other key that differs from `defaults`, under its dotted config name (list items by index)."""
    flat, flat_defaults = flatten(config), flatten(defaults)
    net = getattr(pl_module, "model", None)
    lr_key = next((k for k in LR_KEYS if k in flat), None)
    optimizers = getattr(trainer, "optimizers", None) or [None]
    key = {
        "model": type(net).__name__ if net is not None else type(pl_module).__name__,
        "lr": flat[lr_key] if lr_key else getattr(optimizers[0], "defaults", {}).get("lr"),
        "batch_size": flat.get("data.init_args.batch_size"),
        "max_epochs": trainer.max_epochs,
        "seed": flat.get("seed_everything"),
        "precision": str(trainer.precision),
        "devices": trainer.num_devices,
        "nodes": trainer.num_nodes,
    }
    shown = {
        lr_key,
        "data.init_args.batch_size",
        "trainer.max_epochs",
        "seed_everything",
        "trainer.precision",
    }
    shown |= {"trainer.devices", "trainer.num_nodes", "model.init_args.model.class_path"}
    changed = {
        k: flat.get(k)
        for k in flat  # keys only in the defaults: a value replaced by a mapping (its keys are listed) or a list cut
        if k not in shown and not LOCATION_KEY.search(k) and flat.get(k) != flat_defaults.get(k)
    }
    if not defaults:  # the defaults could not be read: nothing to compare with
        changed = {}
    return {k: _plain(v) for k, v in {**key, **changed}.items()}


def flatten(node, prefix: str = "") -> dict:
    """{"a": {"b": [1, {"c": 2}]}} -> {"a.b.0": 1, "a.b.1.c": 2}; empty dicts and lists stay values."""
    if isinstance(node, dict) and node:
        pairs = node.items()
    elif isinstance(node, list) and node:
        pairs = enumerate(node)
    else:
        return {prefix: node} if prefix else {}
    flat = {}
    for key, value in pairs:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _plain(value):
    """What TensorBoard's hparams accept: bool, int, float, str (None and containers as their YAML text)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
