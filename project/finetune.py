"""FinetuneModule: transfer learning from a pretrained classifier (configs/finetune.yaml).

Not Lightning's BackboneFinetuning (tests/test_finetune.py checks why): its frozen BatchNorm normalises with each
batch's statistics, and it unfreezes by adding a parameter group, which a per-step scheduler fails on. Here every
parameter is in the optimizer from the start (frozen ones get no gradient) and unfreezing flips `requires_grad`."""

from torch import nn

from project.errors import ConfigError
from project.module import ClassificationModule, decay_split

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class FinetuneModule(ClassificationModule):
    """A frozen-then-unfrozen backbone, per-part learning rates; the head is the model's last `nn.Linear`.

    Args:
        model, num_classes: as ClassificationModule's; the model's last `nn.Linear` is the (new) head.
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
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ConfigError(
                f"FinetuneModule needs a model whose head is an nn.Linear; {type(model).__name__} has none. "
                "Use project.models.TorchvisionClassifier, or project.module.ClassificationModule for full training."
            )
        self._head_ids = {id(p) for p in linears[-1].parameters()}
        self.backbone_frozen = False
        if freeze_backbone:
            self._set_backbone_trainable(False)

    def _set_backbone_trainable(self, trainable: bool) -> None:
        for p in self.model.parameters():
            if id(p) not in self._head_ids:
                p.requires_grad_(trainable)
        self.backbone_frozen = not trainable
        self.train(self.training)  # re-apply the BatchNorm mode below

    def train(self, mode: bool = True):
        super().train(mode)
        for m in self.model.modules():  # frozen: normalise with, and do not update, the running statistics
            if mode and self.backbone_frozen and isinstance(m, BATCH_NORMS):
                m.eval()
        return self

    def on_train_epoch_start(self) -> None:
        epoch = self.hparams.unfreeze_epoch
        if self.backbone_frozen and epoch is not None and self.current_epoch >= epoch:
            self._set_backbone_trainable(True)
            self.print(f"Epoch {self.current_epoch}: backbone unfrozen (lr {self._backbone_lr():g}).")

    def _backbone_lr(self) -> float:
        lr = self.hparams.backbone_lr
        return lr if lr is not None else self.scaled_lr(world_size=1) / 10  # the configured lr's tenth

    def param_groups(self) -> list[dict]:
        head = [p for p in self.model.parameters() if id(p) in self._head_ids]
        backbone = [p for p in self.model.parameters() if id(p) not in self._head_ids]
        groups = decay_split(backbone, "backbone", "backbone_no_decay", lr=self._backbone_lr())
        groups += decay_split(head, "head", "head_no_decay")  # no lr: the optimizer's
        return [g for g in groups if g["params"]]  # empty groups left out
