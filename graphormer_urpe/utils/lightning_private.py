"""The private parts of Lightning this package relies on, named in one place (below both
``data/`` and ``training/``, which read them): each function asks what Lightning has no public
way to ask, and the members that ``RunCheckpoint`` and the ``LightningCLI`` subclasses override
or read are listed. A test (``tests/test_lightning_private.py``) checks that every name here
still exists in the installed Lightning, so an upgrade that moves one fails there, not in a run.
"""
from __future__ import annotations

import lightning.pytorch as pl

#: The protected members of ``ModelCheckpoint`` that :class:`~graphormer_urpe.training.run_checkpoint.RunCheckpoint`
#: overrides or reads.
MODEL_CHECKPOINT_MEMBERS = ("_save_checkpoint", "_save_last_checkpoint", "_monitor_candidates",
                            "_should_save_on_train_epoch_end", "_last_global_step_saved",
                            "_last_checkpoint_saved", "_every_n_train_steps")

#: The protected members of ``LightningCLI`` that :class:`~graphormer_urpe.training.lightning_cli.GraphormerCLI`
#: (and the search's check of a trial's configuration) override: where a checkpoint's
#: hyperparameters become the model's arguments.
LIGHTNING_CLI_MEMBERS = ("_parse_ckpt_path",)


def epoch_finished(trainer: pl.Trainer) -> bool:
    """Whether the current training epoch ran all its batches (Lightning ends an epoch that a stop
    cut short as if it were finished)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def batches_done(trainer: pl.Trainer) -> int:
    """Training batches of the current epoch already run (restored from a checkpoint when
    resuming inside an epoch)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def accumulating(trainer: pl.Trainer) -> bool:
    """Whether this training batch only adds to the gradients (``accumulate_grad_batches``, also
    as a ``GradientAccumulationScheduler`` sets it): no optimizer step at its end."""
    return trainer.fit_loop._should_accumulate()


def logs_due(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes its logs at this step (``trainer.log_every_n_steps``)."""
    return trainer._logger_connector.should_update_logs


def limited_batches(trainer: pl.Trainer, batches: int) -> int:
    """The training batches of an epoch of ``batches`` that the trainer runs
    (``trainer.limit_train_batches``, a count or a fraction), as Lightning counts them."""
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    return _parse_num_batches(RunningStage.TRAINING, batches, trainer.limit_train_batches)


def spawn_start_method(strategy) -> str | None:
    """The multiprocessing start method (``spawn``, ``fork``, ``forkserver``) by which the strategy
    starts its processes from this one, pickling what they run into them; None where it starts
    none, or starts them as scripts (DDP's ``popen``)."""
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    launcher = getattr(strategy, "launcher", None)
    return launcher._start_method if isinstance(launcher, _MultiProcessingLauncher) else None


def checkpoint_to_open(trainer: pl.Trainer, subcommand: str, ckpt_path: str | None) -> str | None:
    """The checkpoint that the trainer's ``subcommand`` (fit, validate, test, predict) opens for
    ``ckpt_path``, as Lightning resolves its own names: ``hpc`` (and, under SLURM, no path at all)
    its HPC checkpoint in the run directory, ``registry[:NAME]`` a model registry's download (a
    name it leaves as it is without the ``litmodels`` package). Lightning's ``ValueError`` where a
    name names no file."""
    from lightning.pytorch.trainer.states import TrainerFn

    return trainer._checkpoint_connector._parse_ckpt_path(TrainerFn(subcommand), ckpt_path, model_provided=True,
                                                          model_connected=False)


def replace_process_observer(start) -> None:
    """Lightning's subprocess launcher (DDP's ``popen``, one machine) calls ``start(children)``
    with the processes it started, instead of starting its own watch over them, which kills every
    process, its own included, with SIGKILL within 5 s of one ending with an error."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    subprocess_script._launch_process_observer = start


def trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The module's trainer, or None when it is not attached to one (``module.trainer`` raises)."""
    return module._trainer
