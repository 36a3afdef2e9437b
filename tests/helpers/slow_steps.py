"""A Lightning callback for tests of a fit stopped part-way by a signal (the ablation's time
slices, a multi-process fit): at one step it waits until the signal has arrived, once per marker
file, so the stop falls inside the run however long the process took to start. Changes nothing
trained."""
import time
from pathlib import Path

import lightning.pytorch as pl


class StallOnce(pl.Callback):
    """After training step ``step``, wait (at most ``timeout`` seconds) until the run's
    checkpoint callback holds a SIGTERM or SIGINT back (:class:`~graphormer_urpe.training.run_checkpoint.RunCheckpoint`
    stops at this batch's end), unless ``marker`` exists; creates ``marker``. ``rank``: only that
    process of a multi-process run waits (the one the signal is sent to; the others wait for it
    in the step's collectives). ``batch``: at the end of the epoch's batch of that index instead
    (with accumulation, several batches end at one step)."""

    def __init__(self, step: int = -1, marker: str = "", timeout: float = 300.0, rank: int | None = None,
                 batch: int | None = None) -> None:
        self.step, self.marker, self.timeout, self.rank, self.batch = step, Path(marker), timeout, rank, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        due = batch_idx == self.batch if self.batch is not None else trainer.global_step == self.step
        if not due or (self.rank is not None and trainer.global_rank != self.rank):
            return
        if self.marker.exists():
            return
        self.marker.touch()
        end = time.monotonic() + self.timeout
        while not trainer.checkpoint_callback._held_signal and time.monotonic() < end:
            time.sleep(0.05)
