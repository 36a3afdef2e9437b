"""The private parts of Lightning the package relies on, in one place; ``tests/test_lightning_private.py``
checks that each still exists, so that an upgrade that moves one fails there, not in a run."""
from __future__ import annotations

import lightning.pytorch as pl

#: What :class:`~graphormer_urpe.training.run_checkpoint.RunCheckpoint` overrides or reads of ``ModelCheckpoint``.
MODEL_CHECKPOINT_MEMBERS = ("_save_checkpoint", "_save_last_checkpoint", "_monitor_candidates",
                            "_should_save_on_train_epoch_end", "_last_global_step_saved",
                            "_last_checkpoint_saved", "_every_n_train_steps")

#: What :class:`~graphormer_urpe.training.lightning_cli.GraphormerCLI` overrides of ``LightningCLI``.
LIGHTNING_CLI_MEMBERS = ("_parse_ckpt_path",)


def epoch_finished(trainer: pl.Trainer) -> bool:
    """Whether the training epoch ran all its batches (Lightning ends one that a stop cut short too)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def batches_done(trainer: pl.Trainer) -> int:
    """Training batches of the current epoch already run (restored when resuming inside an epoch)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def accumulating(trainer: pl.Trainer) -> bool:
    """Whether this training batch only accumulates gradients (no optimizer step at its end)."""
    return trainer.fit_loop._should_accumulate()


def logs_due(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes its logs at this step (``trainer.log_every_n_steps``)."""
    return trainer._logger_connector.should_update_logs


def limited_batches(trainer: pl.Trainer, batches: int) -> int:
    """The training batches of an epoch of ``batches`` that ``trainer.limit_train_batches`` leaves."""
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    return _parse_num_batches(RunningStage.TRAINING, batches, trainer.limit_train_batches)


def spawn_start_method(strategy) -> str | None:
    """The multiprocessing start method of the strategy's processes; None where it starts none, or
    starts them as scripts (DDP's ``popen``)."""
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    launcher = getattr(strategy, "launcher", None)
    return launcher._start_method if isinstance(launcher, _MultiProcessingLauncher) else None


def checkpoint_to_open(trainer: pl.Trainer, subcommand: str, ckpt_path: str | None) -> str | None:
    """The checkpoint that ``subcommand`` opens for ``ckpt_path``, as Lightning resolves its names
    (``hpc``, ``registry[:NAME]``); Lightning's ``ValueError`` where one names no file."""
    from lightning.pytorch.trainer.states import TrainerFn

    return trainer._checkpoint_connector._parse_ckpt_path(TrainerFn(subcommand), ckpt_path, model_provided=True,
                                                          model_connected=False)


def replace_process_observer(start) -> None:
    """DDP's launcher calls ``start(children)`` instead of its own watch, which SIGKILLs every process
    within 5 s of one failing."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    subprocess_script._launch_process_observer = start


def trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The module's trainer, or None (``module.trainer`` raises)."""
    return module._trainer
