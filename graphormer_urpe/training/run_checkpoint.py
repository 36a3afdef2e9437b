"""A run's checkpoint folder: what ``last.ckpt`` holds, how it is written, and who may use the folder.

:class:`RunCheckpoint` (``--checkpoint.*``) keeps ``last.ckpt`` the run's newest state, written
whole, so ``--ckpt_path last`` never resumes an older one, and stops a fit by signal at a step's
end; :func:`check_run_dir` decides, before any data is read, what a command does with the folder;
:func:`hold_run_dir` keeps a second ``fit`` out of it; :func:`watch_processes` ends a
multi-process fit that lost a process in one line; :func:`rng_states` are what a checkpoint
carries so that dropout continues as in an uninterrupted run.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from graphormer_urpe.utils.files import AtomicFile, commit_together, hold_directory, is_local_path
from graphormer_urpe.utils.lightning_private import accumulating, epoch_finished, replace_process_observer
from graphormer_urpe.utils.process import replaceable
from graphormer_urpe.utils.workers import exit_status

log = logging.getLogger(__name__)

LAST = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION
OVERWRITE_OPTION = "--checkpoint.overwrite true"
#: In a run directory: held (a file lock) by the process that trains it, and names its pid.
FIT_LOCK = "fit.lock"


#: Signals a fit holds back to the end of its training step in progress: ``kill`` or a
#: scheduler, Ctrl-C, a closed terminal or SSH session.
HELD_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))
#: The signal that stopped this process's last fit, or arrived after its training ended.
_pending_stop = 0


def pending_stop() -> int:
    """The signal (:data:`HELD_SIGNALS`) that stopped the last fit at a step's end, or arrived
    after its training ended, else 0; read once (it is cleared)."""
    global _pending_stop
    signum, _pending_stop = _pending_stop, 0
    return signum


#: The run directories this process holds (by real path) and their lock files.
_held_run_dirs: dict[str, Any] = {}


def hold_run_dir(run_dir: str | os.PathLike) -> None:
    """Hold the run directory's :data:`FIT_LOCK` until the enclosing :func:`run_dirs_released_after`
    block ends, else until this process ends; ``ValueError`` (one line) naming the pid of another
    process that trains it. Only a run's first process takes it (the others are its own)."""
    if rank_zero_only.rank != 0 or os.environ.get("NODE_RANK", "0") != "0":
        return
    key = os.path.realpath(run_dir)
    if key not in _held_run_dirs:
        _held_run_dirs[key] = hold_directory(Path(run_dir), FIT_LOCK, "training run",
                                             "wait for it to end, or choose another --trainer.default_root_dir")


@contextlib.contextmanager
def run_dirs_released_after() -> Iterator[None]:
    """The run directories that :func:`hold_run_dir` takes within the block are released when it
    ends, however it ends (a fit may be one call of a longer process: a notebook, a test session)."""
    before = set(_held_run_dirs)
    try:
        yield
    finally:
        for key in set(_held_run_dirs) - before:
            _held_run_dirs.pop(key).release()


def checkpoints_in(dirpath: str | os.PathLike) -> list[str]:
    """The names of the checkpoint files (``*.ckpt``) in ``dirpath``, sorted; none if it is missing."""
    folder = Path(dirpath)
    return sorted(p.name for p in folder.glob("*" + ModelCheckpoint.FILE_EXTENSION)) if folder.is_dir() else []


def check_run_dir(dirpath: str, ckpt_path: str | None, overwrite: bool, fitting: bool) -> str | None:
    """The checkpoint a command starts from: ``ckpt_path``, except ``last``: ``<dirpath>/last.ckpt``,
    or ``None`` (from scratch) for a ``fit`` whose folder holds no checkpoint. ``ValueError`` (one
    line) for what would lose or mix runs (the messages say which)."""
    found = checkpoints_in(dirpath)
    listed = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    if overwrite and ckpt_path is not None:
        raise ValueError(f"checkpoint.overwrite starts the run over; it cannot resume from "
                         f"--ckpt_path {ckpt_path}: drop one of them")
    if ckpt_path is None:
        if fitting and found and not overwrite:
            raise ValueError(f"{dirpath} already holds checkpoints of a run ({listed}): resume it "
                             "with --ckpt_path last, choose another --trainer.default_root_dir, "
                             f"or start over with {OVERWRITE_OPTION} (removes them)")
        return None
    if ckpt_path != "last":
        return ckpt_path
    if LAST in found:
        return str(Path(dirpath) / LAST)
    if found:
        raise ValueError(f"--ckpt_path last: {dirpath} has no {LAST} but holds {listed}: resume "
                         f"from one of them with --ckpt_path PATH, or start over with {OVERWRITE_OPTION}")
    if not fitting:
        raise ValueError(f"--ckpt_path last: {dirpath} holds no checkpoint; train first, or pass "
                         "--ckpt_path PATH")
    log.warning("--ckpt_path last: no checkpoint in %s; training from scratch", dirpath)
    return None


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (every argument is its own) whose ``last.ckpt`` is always the
    run's newest state (after every validation, every ``every_n_train_steps`` and when ``fit`` ends
    but by an error), always ``last.ckpt``, and every file written whole (a killed run leaves the
    previous one).

    Args:
        overwrite: a ``fit`` without ``--ckpt_path`` into a checkpoint folder that holds
            checkpoints removes them (the ``*.ckpt`` files) when it starts, instead of being
            refused (:func:`check_run_dir`).
    """

    def __init__(self, overwrite: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.overwrite = overwrite
        self._validations = 0  # of this fit
        #: (global step, validations) of the newest last.ckpt this fit wrote
        self._last_written: tuple[int, int] | None = None
        #: The handlers replaced while a fit holds HELD_SIGNALS back, and the held signal
        self._replaced_handlers: dict[int, Any] = {}
        self._held_signal = 0

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key, so checkpoints of either class restore each other's state and
        # readers that look for "ModelCheckpoint..." (the ablation's best_checkpoint) find it.
        return "ModelCheckpoint" + super().state_key[len(type(self).__qualname__):]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.dirpath and trainer.is_global_zero:
            folder = Path(self.dirpath)
            for leftover in folder.glob(".*" + self.FILE_EXTENSION + ".*.part"):  # a killed save's
                leftover.unlink(missing_ok=True)
            if self.overwrite and trainer.ckpt_path is None:
                for name in checkpoints_in(folder):
                    (folder / name).unlink()
                log.info("checkpoint.overwrite: removed the checkpoints in %s", folder)
        super().setup(trainer, pl_module, stage)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if not is_local_path(filepath):
            return super()._save_checkpoint(trainer, filepath)
        with AtomicFile(filepath, binary=True) as output:  # only the first process writes one
            super()._save_checkpoint(trainer, output.temporary)
            if trainer.is_global_zero:
                commit_together([output])
        self._last_checkpoint_saved = filepath
        trainer.strategy.barrier()

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict) -> None:
        if not self.save_last:
            return
        # The one last.ckpt of this folder is this run's (check_run_dir refuses another run's
        # folder), so it is replaced, never versioned as last-v1.ckpt beside it.
        self.last_model_path = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_written = (trainer.global_step, self._validations)

    def _refresh_last(self, trainer: pl.Trainer) -> None:
        """Write ``last.ckpt`` unless it already holds this step and validation (Lightning writes
        it only together with a monitored checkpoint). Lightning's record of what it saved is
        left as it was, so its monitored checkpoints (and the last.ckpt written with them) are
        saved exactly as without this write."""
        if (self.save_last and self._last_written != (trainer.global_step, self._validations)
                and trainer.global_step > 0 and trainer.state.fn == TrainerFn.FITTING
                and not trainer.sanity_checking and not trainer.fast_dev_run
                and not accumulating(trainer)):  # at a cycle's update: no gradients to carry
            saved = self._last_global_step_saved, self._last_checkpoint_saved
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._last_global_step_saved, self._last_checkpoint_saved = saved

    # SIGTERM (a `kill`, a scheduler's preemption, a time slice's end), Ctrl-C, SIGHUP ---------
    # Lightning's SIGTERM handler sets trainer.received_sigterm (and, under DDP, broadcasts from
    # inside the handler, which deadlocks a rank that is in another collective); its loops raise
    # SIGTERMException at the next check, after the on_train_batch_end below, so a step's end
    # would stop with no checkpoint of it; Ctrl-C raises KeyboardInterrupt wherever the process
    # is; SIGHUP (a closed terminal) ends the process on the spot. So while a fit runs, all three
    # are held back (a second Ctrl-C stops at once) to the next training batch's end, where every
    # process learns whether any process got one (one all-reduce), last.ckpt is written, and
    # every process stops at that same step.
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_sanity_check_start(trainer, pl_module)
        self._hold_signals()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._hold_signals()

    def _hold_signals(self) -> None:
        if self._replaced_handlers or threading.current_thread() is not threading.main_thread():
            return
        for signum in HELD_SIGNALS:
            if not replaceable(signum):  # ignored (nohup), or a C handler's
                continue
            self._replaced_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._hold_signal)

    def _hold_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self._held_signal:
            raise KeyboardInterrupt  # Ctrl-C after a held signal: stop now
        if self._held_signal != signal.SIGTERM:
            self._held_signal = signum

    def _release_signals(self) -> None:
        """The handlers as they were; a signal held to the end of the fit (it came after the last
        training step) is kept for the command to stop on (:func:`pending_stop`)."""
        global _pending_stop
        for signum, handler in self._replaced_handlers.items():
            if signal.getsignal(signum) == self._hold_signal:
                signal.signal(signum, handler)
        self._replaced_handlers = {}
        if self._held_signal:
            _pending_stop, self._held_signal = self._held_signal, 0

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self._release_signals()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release_signals()
        super().teardown(trainer, pl_module, stage)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any,
                           **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if accumulating(trainer):
            # Inside an accumulation cycle a checkpoint would carry its summed gradients: a held
            # signal waits for the cycle's update, on every process alike.
            return
        # A held signal of any process (SIGTERM before SIGINT) stops every process right after
        # this batch: its end is the state a resume continues from.
        stop_signal = self._held_signal
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            flag = torch.tensor([stop_signal], dtype=torch.int32, device=trainer.strategy.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            stop_signal = int(flag.item())
        stopping = stop_signal or trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step
        every_n = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        if stopping or every_n:  # the state a resume inside the epoch continues from exactly
            self._refresh_last(trainer)
        if stop_signal:
            global _pending_stop
            self._held_signal, _pending_stop = 0, stop_signal
            raise SIGTERMException

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._validations += 1
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):  # else at the epoch end, next
            self._refresh_last(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning ends an epoch that a stop (max_steps, max_time) cut short as if it were
        # finished: a checkpoint of that state would resume at the next epoch, skipping the rest.
        if epoch_finished(trainer):
            super().on_train_epoch_end(trainer, pl_module)
            self._refresh_last(trainer)
            return
        # Stopped inside the epoch: last.ckpt keeps the state of the last batch's end.
        save_last, self.save_last = self.save_last, False
        try:
            super().on_train_epoch_end(trainer, pl_module)
        finally:
            self.save_last = save_last

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not ModelCheckpoint's own, which writes last.ckpt when it wrote none itself: after a
        # stop inside an epoch, Lightning has marked that epoch complete by now, and such a
        # last.ckpt would resume at the next epoch. The batch's end wrote the state to resume.
        if epoch_finished(trainer):
            self._refresh_last(trainer)


# The processes of a multi-process fit -------------------------------------------------------
#: How long the first process of a multi-process fit, once a process it started has ended with an
#: error, lets its own work fail (its next collective does at once on gloo, NCCL may wait for its
#: timeout) before it ends the fit itself.
LOST_PROCESS_GRACE_S = 30.0
#: The processes that Lightning's launcher started from this one for the fit, in rank order.
_started: list[subprocess.Popen] = []
#: Held while a lost process is said: by the command, or by the watch (once).
_saying_lost = threading.Lock()


def watch_processes() -> None:
    """The first process of a multi-process fit watches the others it starts, instead of
    Lightning's watch, which SIGKILLs every process, this one included, within 5 s of one ending
    with an error; where the fit does not end by itself within :data:`LOST_PROCESS_GRACE_S` of
    that, the watch ends it with :func:`lost_process`'s line, exit status 1."""
    def watch(children: list[subprocess.Popen]) -> None:
        _started[:] = children
        threading.Thread(target=_end_when_lost, name="graphormer-urpe-process-watch", daemon=True).start()

    replace_process_observer(watch)


def _end_when_lost() -> None:
    while not any(child.poll() not in (None, 0) for child in _started):
        if all(child.returncode == 0 for child in _started):
            return
        time.sleep(1.0)
    time.sleep(LOST_PROCESS_GRACE_S)  # the fit fails at its next collective and says so itself
    lost = lost_process()
    if lost is not None:  # else the command says it
        print(f"graphormer-urpe: error: {lost}", file=sys.stderr, flush=True)
        os._exit(1)


def lost_process() -> str | None:
    """Which process that this one started for the fit ended with an error, and how, with the way
    on; None if none did or it was said already. The others, which can neither go on without it
    nor end by themselves, are killed."""
    if not _saying_lost.acquire(blocking=False):
        return None
    lost = next(((rank, child) for rank, child in enumerate(_started, start=1) if child.poll() not in (None, 0)),
                None)
    if lost is None:
        _saying_lost.release()
        return None
    end_started_processes()
    rank, child = lost
    rank += int(os.environ.get("NODE_RANK", "0")) * (len(_started) + 1)
    status = exit_status(child.returncode)
    if child.returncode == -signal.SIGKILL:  # the out-of-memory killer's signal
        status = status.replace(")", ": out of memory?)")
    return (f"process {rank} of {os.environ.get('WORLD_SIZE', len(_started) + 1)} (pid {child.pid}) ended with "
            f"exit status {status}, so the fit stopped; resume it with --ckpt_path last")


def end_started_processes() -> None:
    """Kill the processes this one started for the fit that still run, and wait for them."""
    for child in _started:
        if child.poll() is None:
            child.kill()
        child.wait()


def rng_states() -> dict[str, Any]:
    """The global random states: torch CPU, every CUDA device's, numpy's and Python's, as
    tensors and plain values (a checkpoint loads with ``weights_only=True``)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "torch.cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
            "python": random.getstate()}


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore :func:`rng_states` (the CUDA states where this process has as many devices)."""
    torch.set_rng_state(states["torch"].cpu())
    cuda = states.get("torch.cuda") or []
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([state.cpu() for state in cuda])
    kind, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
