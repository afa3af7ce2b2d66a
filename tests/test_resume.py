from lightning.pytorch.callbacks import Callback


class StopAfterEpoch(Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch + 1 == self.epoch:
            raise SystemExit(99)
