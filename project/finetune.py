"""FinetuneModule: transfer learning from a pretrained classifier (configs/finetune.yaml).

The head is the model's last `nn.Linear` (the layer TorchvisionClassifier resizes to num_classes); everything
else is the backbone. The backbone can start frozen (its BatchNorm layers then stay in eval mode, so their
running statistics keep the pretrained values), be unfrozen at an epoch, and train with its own, usually
lower, learning rate in separate parameter groups: `backbone`, `backbone_no_decay`, `head`, `head_no_decay`.

Not Lightning's BaseFinetuning/BackboneFinetuning callbacks, for two reasons checked by running them (lightning
2.6.6, torch 2.14.1; tests/test_finetune.py keeps checking both):
- `BaseFinetuning.freeze_module` sets BatchNorm's `track_running_stats=False`. The Trainer keeps the model in
  train mode, and a BatchNorm in train mode without tracked statistics normalises with each batch's own
  statistics: a frozen layer's output then differs from the pretrained model's (which uses the stored running
  statistics), although those statistics stay untouched. BackboneFinetuning's default `train_bn=True` does not
  freeze BatchNorm at all.
- They unfreeze by adding a parameter group to the optimizer mid-run. A scheduler built before then keeps one
  `base_lr` per original group, and torch 2.14's `scheduler.step()` zips the groups with `strict=True`: with the
  per-step schedule the run stopped at the first step after unfreezing with `ValueError: zip() argument 2 is
  shorter than argument 1`. Here every parameter is in the optimizer from the start (frozen ones get no gradient,
  so the optimizer skips them), and unfreezing only flips `requires_grad`.
BackboneFinetuning also needs a `backbone` attribute on the LightningModule; here any classifier whose head is its
last `nn.Linear` works.
"""

from torch import nn

from project.errors import ConfigError
from project.module import ClassificationModule

# torch's batch-norm layers (their private base class, _BatchNorm, named by its public subclasses)
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class FinetuneModule(ClassificationModule):
    """ClassificationModule with a frozen-then-unfrozen backbone and per-part learning rates.

    Args:
        model: a classifier whose last `nn.Linear` is the (new) head, e.g. project.models.TorchvisionClassifier.
        num_classes: number of classes; linked from the data module by the CLI.
        freeze_backbone: train only the head at first; BatchNorm statistics of the backbone stay frozen too.
        unfreeze_epoch: epoch from which the backbone trains as well; None keeps it frozen for the whole run.
            Under DDP, unfreezing mid-run is not supported (DDP registers trainable parameters at the start):
            use a second run from the checkpoint instead.
        backbone_lr: peak learning rate of the backbone once it trains; None means the optimizer's lr / 10. The
            head trains at the optimizer's lr.
        **kwargs: ClassificationModule's arguments (optimizer, scheduler, label_smoothing, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        freeze_backbone: bool = True,
        unfreeze_epoch: int | None = None,
        backbone_lr: float | None = None,
        **kwargs,
    ) -> None:
        super().__init__(model, num_classes, **kwargs)
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ConfigError(
                f"FinetuneModule needs a model whose head is an nn.Linear; {type(model).__name__} has none. "
                "Use project.models.TorchvisionClassifier, or project.module.ClassificationModule for full training."
            )
        head = model.get_submodule(linears[-1])
        self._head_ids = {id(p) for p in head.parameters()}
        self._backbone_norms = [m for m in model.modules() if isinstance(m, BATCH_NORMS)]
        self.backbone_frozen = False
        if freeze_backbone:
            self._set_backbone_trainable(False)

    def backbone_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if id(p) not in self._head_ids]

    def head_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if id(p) in self._head_ids]

    def _set_backbone_trainable(self, trainable: bool) -> None:
        for p in self.backbone_parameters():
            p.requires_grad_(trainable)
        self.backbone_frozen = not trainable
        self.train(self.training)  # re-apply the BatchNorm mode below

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.backbone_frozen:
            # eval mode: normalise with, and do not update, the running statistics
            for norm in self._backbone_norms:
                norm.eval()
        return self

    def on_train_epoch_start(self) -> None:
        epoch = self.hparams.unfreeze_epoch
        if self.backbone_frozen and epoch is not None and self.current_epoch >= epoch:
            self._set_backbone_trainable(True)
            self.print(f"Epoch {self.current_epoch}: backbone unfrozen (lr {self._backbone_lr():g}).")

    def _backbone_lr(self) -> float:
        return self.hparams.backbone_lr if self.hparams.backbone_lr is not None else self.configured_lr() / 10

    def param_groups(self) -> list[dict]:
        """`backbone`, `backbone_no_decay` (at backbone_lr), `head`, `head_no_decay` (at the optimizer's lr).

        Frozen parameters are in the optimizer from the start: optimizers skip parameters without a gradient,
        so they stay untouched (no weight decay either) until unfrozen; no optimizer surgery needed later.
        Biases and norm scales (1-D) are not decayed. Empty groups are left out.
        """
        groups = []
        for part, params, lr in (
            ("backbone", self.backbone_parameters(), {"lr": self._backbone_lr()}),
            ("head", self.head_parameters(), {}),  # no lr: the optimizer's
        ):
            decay, no_decay = [p for p in params if p.ndim > 1], [p for p in params if p.ndim <= 1]
            groups += [
                {"name": part, "params": decay, **lr},
                {"name": f"{part}_no_decay", "params": no_decay, "weight_decay": 0.0, **lr},
            ]
        return [g for g in groups if g["params"]]
