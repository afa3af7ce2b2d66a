"""BlockLoader: litdata's StreamingDataLoader, with small training batches sent from its workers in blocks.

A batch made by a loader worker reaches the training process at a fixed cost per message, whatever its size:
torch moves each tensor through shared memory and hands its file descriptor over a new socket connection to a
thread of the worker (the "file_descriptor" sharing strategy), then the DataLoader and litdata do their
bookkeeping. For small batches that cost is most of the loader's time in the training process, and the model
waits for it. Pickling numpy arrays through the worker's pipe costs less per message for small batches and more
for large ones, whose bytes the pipe copies: the crossover lies between batches of 64 images of 3x32x32 and of
3x64x64 (one worker, the median wait for a batch of 64 as tensors / as arrays: 1x8x8 2.8 / 1.0 ms, 3x32x32
3.0 / 1.7 ms, 3x64x64 3.4 / 4.2 ms, 3x224x224 5.0 / 26.6 ms).

So a training batch up to `BLOCK_BYTES` travels with the next ones as one block of up to `MAX_BATCHES_PER_BLOCK`
batches, as numpy arrays (pickled through the worker's pipe, no shared memory), and the training process turns the
block back into tensors (no copy) and hands out its batches one by one as views: one message per block, not per
batch. Larger batches travel alone, as tensors, as litdata sends them.

What stays as it was:
- The batches: a block is litdata's batch of `batch_size x k` samples, cut into k batches of `batch_size`; the
  order is litdata's for the block size (seed, epoch, rank, worker), the same after a resume.
- The samples per epoch: k is chosen so that litdata's drop_last, which now drops to whole blocks, leaves out no
  more samples than it does for single batches (`batches_per_block`); ranks compute the same k, so DDP ranks stay in
  lockstep.
- Exact resume: litdata's state counts whole blocks. A checkpoint taken after batch j of a block saves litdata's
  state from before that block and j; the resumed loader reads the block again and skips its first j batches.
  Lightning does not prefetch from a loader with a length, so "handed out" is "trained on". Resumed on other
  devices, workers or batch size (litdata's elastic resume), the block read again is another one: its batches are
  then all handed out, with a warning that up to j batches per rank are trained on twice.
- Evaluation loaders use k = 1 (each sample counted once, as litdata gives it).

The next epoch starts early (`prestart`, training loaders with workers): when an epoch's last batch is handed out,
a thread runs litdata's start of the next epoch (the workers' reset) up to its first block, which the worker reads
during the last step, validation and checkpoints. A checkpoint taken in between saves the next epoch's start.
Without it every epoch's first batch would wait for the reset and a whole block (12-25 ms an epoch on the digits,
one worker).

The cost: with pinned memory (a GPU) a block's arrays are not pinned, so their (small) copies to the device are
synchronous.
"""

import itertools
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from litdata import StreamingDataLoader, StreamingDataset
from torch import Tensor
from torch.utils.data import default_collate

from project.errors import ConfigError

BLOCK_BYTES = 256 * 1024  # a block's size limit, below the pipe's crossover that the module docstring names
# 1/8 of the per-message cost is below the noise of a step; longer blocks make each block's read longer
MAX_BATCHES_PER_BLOCK = 8


def batches_per_block(dataset: StreamingDataset, workers: int, batch_size: int, batch_bytes: int) -> int:
    """The k for a training loader: as many batches per block as fit BLOCK_BYTES (at most MAX_BATCHES_PER_BLOCK),
    halved until litdata's drop_last, which drops to whole blocks, keeps as many samples as with single batches."""
    if workers == 0:
        return 1  # no worker, no message to save
    k = 1
    while k * 2 <= MAX_BATCHES_PER_BLOCK and k * 2 * batch_bytes <= BLOCK_BYTES:
        k *= 2
    full = dataset.get_len(workers, batch_size)
    while k > 1 and dataset.get_len(workers, batch_size * k) < full:
        k //= 2
    dataset.set_batch_size(batch_size)  # get_len sets it; the loader sets its own
    return k


def collate_to_numpy(samples: list) -> Any:
    """litdata's default collate for these samples (torch's default_collate), as numpy arrays."""
    return apply_to_collection(default_collate(samples), Tensor, Tensor.numpy)


class BlockLoader(StreamingDataLoader):
    """A StreamingDataLoader that hands out `batch_size` batches read `batches_per_block` at a time.

    Args:
        dataset: the StreamingDataset.
        batch_size: samples per batch handed out.
        batches_per_block: k (see `batches_per_block()`); 1 is litdata's StreamingDataLoader with tensors.
        prestart: when the epoch's last batch is handed out, start the next epoch (the workers' reset and its first
            block) in a thread, so that it is read while the last step, validation and checkpoints run.
        epoch: the training epoch (0-based) an `iter()` starts, e.g. `lambda: trainer.current_epoch`; None counts
            the loader's own `iter()` calls (litdata's way). Lightning restores a loader's state only when the
            checkpoint is inside an epoch: resumed from an epoch's end, the loader's own count would restart at
            the first epoch and read its order again.
        fix: what to do when a chunk file goes missing during the run (said in the error).
        **kwargs: StreamingDataLoader's arguments (num_workers, pin_memory, drop_last, ...).
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        batch_size: int,
        batches_per_block: int = 1,
        prestart: bool = False,
        epoch: Callable[[], int] | None = None,
        fix: str = "Write the dataset again with the `python -m project prepare` command that wrote it, adding "
        "--overwrite true.",
        **kwargs: Any,
    ):
        if batches_per_block > 1:
            kwargs["collate_fn"] = collate_to_numpy
        super().__init__(dataset, batch_size=batch_size * batches_per_block, **kwargs)
        self.batches_per_block, self.batch_size_out = batches_per_block, batch_size
        self._done = 0  # batches of the current block handed out
        self._before: dict | None = None  # litdata's state before the current block (None: the epoch's start)
        self._skip = 0  # batches of the first block to leave out after load_state_dict
        self._loaded: dict | None = None  # the litdata state load_state_dict restored (mid-epoch)
        self._handed_out = False  # the current epoch's last batch has been handed out
        self.prestart = prestart
        self.epoch, self.fix = epoch, fix
        # the started next epoch: its thread, litdata's generator of blocks, {"block" or "error": ...}, and its
        # training epoch
        self._next: tuple[threading.Thread, Any, dict, int] | None = None

    def __len__(self) -> int:
        return super().__len__() * self.batches_per_block

    def __iter__(self):
        # A generator: nothing below runs before the first batch is asked for, so `self.epoch()` reads the epoch
        # being trained (Lightning calls iter() for a resumed run before it has counted the finished epoch).
        if self._next is not None and self.epoch is not None and self._next[3] != self.epoch():
            self._drop_started_epoch()  # started for an epoch that is not the one being trained
        if self._next is not None:
            blocks_iter = self._reads(self._started_epoch)
        else:
            if self._handed_out:
                # Lightning takes len(self) batches and never exhausts the generator, so litdata's end-of-epoch code
                # does not run: after a resumed epoch its `restore` stays on, and with no worker process the next
                # epoch would replay the restored state instead of starting (an empty epoch: litdata 0.2.76).
                self.restore = False
            if not self.restore and self.epoch is not None:
                # litdata counts epochs from 1 and adds one at each fresh iter(): (seed, epoch + 1) is this
                # epoch's order whatever the loader saw before (a mid-epoch restore keeps the saved epoch).
                self.current_epoch = self.epoch()
            blocks_iter = self._reads(lambda: StreamingDataLoader.__iter__(self))
        self._handed_out = False
        k, b, blocks = self.batches_per_block, self.batch_size_out, super().__len__()
        skip, self._skip = self._skip, 0
        self._done, self._before, self._loaded = 0, self._loaded, None
        for block in blocks_iter:
            last = self._num_samples_yielded_streaming >= blocks * self.batch_size  # the epoch's last block
            if k > 1:
                block = apply_to_collection(block, np.ndarray, torch.from_numpy)
            for i in range(skip, k):
                self._done, self._handed_out = i + 1, last and i == k - 1
                if self._handed_out and self.prestart:
                    self._start_next_epoch()
                yield (
                    block
                    if k == 1
                    else apply_to_collection(block, Tensor, lambda t, i=i: t[i * b : (i + 1) * b])
                )
            skip = 0
            if k > 1:
                self._before = super().state_dict()  # after this block = before the next

    def _reads(self, blocks: Callable[[], Any]):
        """litdata's blocks, with a chunk file missing from a local dataset reported as that."""
        try:
            yield from blocks()
        except Exception as err:
            missing = self._missing_chunk(err)
            if missing is None:
                raise
            raise missing from err

    def _missing_chunk(self, err: Exception) -> ConfigError | None:
        """litdata waits for a chunk file that is not on disk as for a download in progress, then times out
        blaming "a hung or crashed download" (litdata 0.2.76; from a worker, as a RuntimeError with that text).
        A local dataset downloads nothing: the file was deleted or moved after the run checked it."""
        found = re.search(r"waiting for chunk (\S+?)\.? ", str(err))
        input_dir = getattr(self.dataset, "input_dir", None)
        if found is None or input_dir is None or input_dir.url or os.path.exists(found.group(1)):
            return None
        return ConfigError(
            f"'{found.group(1)}' is missing: the chunk file was deleted or moved while this run was reading "
            f"'{input_dir.path}' (litdata waited for it as for a download). {self.fix} Then resume the run with "
            "--ckpt_path last."
        )

    def _start_next_epoch(self) -> None:
        """litdata's next epoch, up to its first block, in a thread (mostly waiting for the worker: no GIL)."""
        self.restore = False  # see __iter__
        following = (self.epoch() if self.epoch is not None else self.current_epoch) + 1
        if self.epoch is not None:
            self.current_epoch = following  # the next training epoch: litdata's epoch following + 1
        blocks = StreamingDataLoader.__iter__(self)
        first: dict = {}

        def read_first() -> None:
            try:
                first["block"] = next(blocks)
            except BaseException as err:  # noqa: BLE001 - raised again in the training thread by _started_epoch
                first["error"] = err

        thread = threading.Thread(target=read_first, name="stream-next-epoch", daemon=True)
        thread.start()
        self._next = (thread, blocks, first, following)

    def _drop_started_epoch(self) -> None:
        thread, blocks, _, _ = self._next
        self._next = None
        thread.join()
        blocks.close()
        self.restore = False

    def _started_epoch(self):
        """The blocks of the epoch `_start_next_epoch` started, its first one included."""
        thread, blocks, first, _ = self._next
        self._next = None
        thread.join()
        if isinstance(first.get("error"), StopIteration):
            return iter(())
        if "error" in first:
            raise first["error"]
        return itertools.chain([first["block"]], blocks)

    def state_dict(self) -> dict[str, Any]:
        if self._next is not None:
            # The epoch is over and the next one started (prestart): a state at the next epoch's start.
            self._next[0].join()
            return {"current_epoch": self.current_epoch, "epoch_start": True, "block_batches_done": 0}
        if self.batches_per_block == 1 or self._done in (0, self.batches_per_block):
            return super().state_dict()  # at a block's end litdata's own state is exact
        mid_block = {"block_batches_done": self._done, "block_layout": self._layout()}
        if self._before is None:  # in the epoch's first block: its start, then skip
            return {"current_epoch": self.current_epoch, "epoch_start": True, **mid_block}
        return {**self._before, **mid_block}

    def _layout(self) -> dict[str, int]:
        """What decides which samples a block holds, besides litdata's own state."""
        env = getattr(self.dataset, "distributed_env", None)
        return {
            "world_size": int(getattr(env, "world_size", 1)),
            "num_workers": self.num_workers,
            "batch_size": self.batch_size_out,
            "batches_per_block": self.batches_per_block,
        }

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        obj = dict(obj)
        self._handed_out, self._next = False, None
        self._skip = obj.pop("block_batches_done", 0)
        layout, now = obj.pop("block_layout", None), self._layout()
        if self._skip and layout is not None and layout != now:
            # litdata resumes elastically (other devices, workers or batch size) from the state before the block,
            # but the block it then reads is another one: skipping the saved j batches of it would drop samples.
            changed = ", ".join(f"{k} {v} -> {now[k]}" for k, v in layout.items() if v != now[k])
            rank_zero_warn(
                f"Resuming a streaming epoch with another layout ({changed}): the batches of the interrupted block "
                f"are read again, so up to {self._skip} batches per rank are trained on twice. Resume with the "
                "same devices, num_workers and batch_size to continue exactly."
            )
            self._skip = 0
        if obj.pop("epoch_start", False):
            # A fresh start of that epoch: iter() counts it (current_epoch + 1) and reads litdata's (seed, epoch) order.
            self.current_epoch = obj["current_epoch"] - 1
            self.restore, self._loaded = False, None
            return
        super().load_state_dict(obj)
        self._loaded = obj
