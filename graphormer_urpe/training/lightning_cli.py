"""The configuration of ``graphormer-urpe {fit,validate,test,predict}``: :class:`GraphormerCLI`, a
LightningCLI over the module and the datamodules, built by :func:`build_cli`.

The data's facts (:class:`~graphormer_urpe.data.facts.DataFacts`) are linked from the DataModule
into the model, so a config names each once. A run's outputs all go under
``trainer.default_root_dir``: TensorBoard and CSV logs, ``checkpoints/`` (the best by the task's
validation metric, and ``last.ckpt``: :mod:`~graphormer_urpe.training.run_checkpoint`) and
``predict``'s table. Its refusals before any data is read are
:mod:`~graphormer_urpe.training.fit_checks`; every checkpoint a command opens, whatever names it
(a path, ``last``, ``best``, ``hpc``), is read as data first
(:func:`~graphormer_urpe.utils.torch_files.read_checkpoint`).
"""
from __future__ import annotations

import csv
import importlib
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import (BasePredictionWriter, GradientAccumulationScheduler, LearningRateMonitor,
                                         Timer, TQDMProgressBar)
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_module
from tqdm import tqdm

from graphormer_urpe.data.dataset import check_seed
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.data.task import get_task
from graphormer_urpe.prediction.load import checkpoint_arguments, recorded_best
from graphormer_urpe.training.fit_checks import (PREDICTIONS_FILE, check_checkpoint_data, check_checkpoint_model,
                                                 check_epoch_place, check_prediction_output,
                                                 check_schedule_config, check_step_config, check_trainer,
                                                 device_count, epoch_place)
from graphormer_urpe.training.curves import CSV_LOGS, TENSORBOARD_LOGS, newest_version
from graphormer_urpe.training.module import GraphormerModule, data_position
from graphormer_urpe.training.recipes import command_line
from graphormer_urpe.training.run_checkpoint import (LAST, RunCheckpoint, check_run_dir, hold_run_dir,
                                                      run_dirs_released_after)
from graphormer_urpe.utils.extras import missing_extra
from graphormer_urpe.utils.files import check_creatable_dir, check_writable_dir, is_local_path
from graphormer_urpe.utils.lightning_private import checkpoint_to_open
from graphormer_urpe.utils.torch_files import read_checkpoint

DEFAULT_RUN_DIR = "runs/default"
#: ``--ckpt_path`` values that Lightning resolves itself once the trainer is built
#: (:func:`~graphormer_urpe.utils.lightning_private.checkpoint_to_open`); ``last`` and ``best``
#: are resolved here, from the run's checkpoint folder.
LIGHTNING_CKPT_NAMES = ("hpc", "registry")  # also registry:<name>


class PredictionWriter(BasePredictionWriter):
    """Writes ``predict``'s outputs to a CSV with the columns of ``graphormer-urpe-predict``, in
    the order of the predict split.

    Args:
        output: the CSV (default: ``<trainer.default_root_dir>/predictions.csv``).
    """

    def __init__(self, output: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output = output

    def write_on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           predictions, batch_indices) -> None:
        from graphormer_urpe.prediction.table import InputRow, prediction_columns, write_predictions

        # a flat list for one predict loader, a list of lists for several
        per_loader = predictions if predictions and isinstance(predictions[0], list) else [predictions]
        outputs = [o for loader in per_loader for o in loader]
        if not outputs:
            return
        index = torch.cat([o["index"] for o in outputs]).cpu().numpy()
        values = torch.cat([o["prediction"] for o in outputs]).float().cpu().numpy()
        values = values[np.argsort(index, kind="stable")]
        smiles_of = getattr(trainer.datamodule, "predict_smiles", None)
        smiles = smiles_of() if smiles_of is not None else None
        rows = [InputRow(smiles[i] if smiles is not None else "") for i in range(len(values))]
        path = Path(self.output or os.path.join(trainer.default_root_dir, PREDICTIONS_FILE))
        write_predictions(path, rows, values, prediction_columns(pl_module))
        logging.getLogger(__name__).info("wrote %d predictions to %s", len(rows), path)


class RunProgressBar(TQDMProgressBar):
    """Lightning's progress bar, whose postfix also says how long the whole run has left
    (``run_left``); the bar's own estimate covers one epoch."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._started = (time.monotonic(), trainer.global_step)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        items = super().get_metrics(trainer, pl_module)
        left = run_time_left(trainer, *getattr(self, "_started", (time.monotonic(), trainer.global_step)))
        if left is not None:
            items["run_left"] = tqdm.format_interval(left)
        return items


def run_time_left(trainer: pl.Trainer, started: float, start_step: int) -> float | None:
    """Seconds the fit has left: its remaining optimizer steps at the pace of those since
    ``started`` (at step ``start_step``), at most what ``max_time`` leaves; None if unknown."""
    left = []
    steps = trainer.global_step - start_step
    total = trainer.estimated_stepping_batches
    if steps > 0 and math.isfinite(total):
        left.append((time.monotonic() - started) / steps * max(total - trainer.global_step, 0))
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is not None and timer.time_remaining() is not None:
        left.append(max(timer.time_remaining(), 0.0))
    return min(left) if left else None


class RunCSVLogger(CSVLogger):
    """Lightning's CSVLogger, continuing the ``metrics.csv`` of its version folder where Lightning's
    would delete it: a resumed fit logs into the version it started in (one run, one curve)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            metrics = Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE
            kept = metrics.read_text(encoding="utf-8") if metrics.is_file() else None
            with warnings.catch_warnings():  # "Previous log files in this directory will be deleted"
                warnings.filterwarnings("ignore", message="Experiment logs directory")
                writer = super().experiment
            if kept:
                metrics.write_text(kept, encoding="utf-8")
                writer.metrics_keys = next(csv.reader(kept.splitlines()), [])
        return self._experiment


def fit_summary(trainer: pl.Trainer, seconds: float) -> str:
    """What a fit leaves: steps, wall time, the best and the last checkpoint."""
    checkpoint = trainer.checkpoint_callback
    lines = [f"optimizer steps   {trainer.global_step} (epoch {trainer.current_epoch})",
             f"wall time         {seconds / 60:.1f} min"]
    if checkpoint is not None:
        best = getattr(checkpoint, "best_model_path", "")
        score = getattr(checkpoint, "best_model_score", None)
        lines.append(f"best checkpoint   {best} ({checkpoint.monitor} {float(score):.4f})" if best and score is not None
                     else f"best checkpoint   none (no {getattr(checkpoint, 'monitor', None) or 'validation'} was logged)")
        last = getattr(checkpoint, "last_model_path", "")
        lines.append(f"last checkpoint   {last or 'none'}")
    return "\n".join(lines)


#: Run arguments that say how the steps run, not what is trained: a run or an ablation grid
#: started with or without them continues either way.
EXECUTION_ARGS = ("--model.compile",)


def training_args(args: list[str]) -> list[str]:
    """``args`` without :data:`EXECUTION_ARGS` (``--name value`` or ``--name=value``)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in EXECUTION_ARGS:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in EXECUTION_ARGS)):
            kept.append(arg)
    return kept


#: Each subcommand's line in ``graphormer-urpe --help`` and its description (Lightning's are the
#: first lines of the Trainer's docstrings, some cut mid-sentence).
SUBCOMMAND_HELP = {
    "fit": "Train a model; --ckpt_path last resumes the run.",
    "validate": "One pass over the validation split: its metrics.",
    "test": "One pass over the test split: its metrics (e.g. --ckpt_path best).",
    "predict": "Predictions for the data's predict split, written as a CSV.",
}


class GraphormerCLI(LightningCLI):
    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        for choice in parser._subcommands_action._choices_actions:  # jsonargparse's listing
            choice.help = SUBCOMMAND_HELP.get(choice.dest, choice.help)

    def _parse_ckpt_path(self) -> None:
        """As LightningCLI's, the hyperparameters read as ``graphormer-urpe-predict`` reads them,
        except the facts, which are linked from the data."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        hparams = {k: v for k, v in checkpoint_arguments(self._read_checkpoint(ckpt_path)[1]).items()
                   if k != "facts"}
        if hparams:
            try:
                self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
            except SystemExit:
                sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
                raise

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        # before Lightning seeds with it: its own out-of-range error is a traceback
        subcommand = self.config.get("subcommand")
        seed = (self.config[subcommand] if subcommand else self.config).get("seed_everything")
        if seed is not None and not isinstance(seed, bool):
            check_seed("seed_everything", seed)

    def _read_checkpoint(self, ckpt_path: str) -> tuple[str, dict, dict]:
        """``(path, hyperparameters, where it stands in its epoch)`` of the checkpoint the
        command starts from, read once as data (a damaged or crafted file: one line)."""
        cached = getattr(self, "_checkpoint", None)
        if cached is None or cached[0] != ckpt_path:
            checkpoint = read_checkpoint(ckpt_path)
            checkpoint = checkpoint if isinstance(checkpoint, dict) else {}
            hparams = checkpoint.get("hyper_parameters")
            self._checkpoint = cached = (ckpt_path, hparams if isinstance(hparams, dict) else {},
                                         epoch_place(checkpoint))
        return cached

    def after_instantiate_classes(self) -> None:
        """Before any data is read: the built trainer's settings and the checkpoint's fit. A run
        without a logger drops the learning-rate monitor, which Lightning would stop on."""
        if self.trainer is not None and not self.trainer.loggers:
            self.trainer.callbacks = [c for c in self.trainer.callbacks if not isinstance(c, LearningRateMonitor)]
        if self.trainer is not None:  # Lightning's own bar, which estimates one epoch: the run's
            self.trainer.callbacks = [RunProgressBar(c.refresh_rate, c.process_position, c._leave)
                                      if type(c) is TQDMProgressBar else c for c in self.trainer.callbacks]
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand is None:
            return
        check_trainer(self.trainer, config.trainer, self.subcommand)
        ckpt_path = self._checkpoint_to_open(config)
        if ckpt_path and is_local_path(ckpt_path):  # a missing, damaged or crafted file: one line
            path, hparams, place = self._read_checkpoint(ckpt_path)
            check_checkpoint_data(path, hparams, self.model)
            check_checkpoint_model(path, hparams, self.model)
            scheduled = any(isinstance(c, GradientAccumulationScheduler) for c in self.trainer.callbacks)
            if self.subcommand == "fit" and not scheduled:  # a scheduler's factor depends on the epoch
                check_epoch_place(path, place, data_position(self.trainer, self.datamodule))

    def _checkpoint_to_open(self, config: Namespace) -> str | None:
        """The checkpoint the subcommand opens: ``--ckpt_path``, or the file Lightning's own names
        (``hpc``, ``registry``, SLURM's) mean, then given to the subcommand so that the file
        checked is the file opened; ``ValueError`` (one line) where there is none."""
        given = config.get("ckpt_path")
        try:
            ckpt_path = checkpoint_to_open(self.trainer, self.subcommand, given)
        except ValueError:  # Lightning's, in terms of its Python API: "hpc" where it finds none
            raise ValueError(f"--ckpt_path {given}: {self.trainer.default_root_dir} holds no checkpoint of that "
                             "name (hpc_ckpt_N.ckpt, which Lightning writes when SLURM requeues a run); give a "
                             "checkpoint file") from None
        if ckpt_path is not None and str(ckpt_path).split(":")[0] in LIGHTNING_CKPT_NAMES:
            raise ValueError(f"--ckpt_path {given}: Lightning's model registry needs the litmodels package, "
                             "which is not installed; give a checkpoint file")
        if ckpt_path != given:
            config.ckpt_path = self.config_init[self.subcommand]["ckpt_path"] = str(ckpt_path)
        return config.ckpt_path

    def before_fit(self) -> None:
        self._fit_started = time.monotonic()

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(f"=== graphormer-urpe fit: {self.trainer.default_root_dir} ===\n"
                  f"{fit_summary(self.trainer, time.monotonic() - self._fit_started)}", flush=True)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data", "model.facts", apply_on="instantiate", compute_fn=DataFacts.of)
        parser.link_arguments("data", "model.target_names", apply_on="instantiate",
                              compute_fn=lambda data: getattr(data, "target_columns", None))
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        # monitor / mode / filename left unset follow the task (before_instantiate_classes).
        parser.set_defaults({"checkpoint.save_last": True,
                             "checkpoint.auto_insert_metric_name": False})
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.add_lightning_class_args(PredictionWriter, "prediction_writer")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        run_dir = config.trainer.default_root_dir or DEFAULT_RUN_DIR
        config.trainer.default_root_dir = run_dir
        check_kernel_installed(config)
        if self.subcommand == "fit":
            check_schedule_config(config)  # before any data is read
            check_step_config(config.trainer)
        if self.subcommand is not None:  # its logs (and a fit's checkpoints) go there
            check_writable_dir(run_dir, "--trainer.default_root_dir")
        if self.subcommand == "fit":
            # before the checkpoint folder is checked: a second fit must not remove the first's
            hold_run_dir(run_dir)
        if self.subcommand == "predict":
            if device_count(config.trainer) > 1:
                raise ValueError("graphormer-urpe predict writes one table from one process: give "
                                 "--trainer.devices 1 (graphormer-urpe-predict --workers N predicts in parallel)")
            config_files = [*(self.config.get("config") or []), *(config.get("config") or [])]
            check_prediction_output(config, config_files)  # before the data and the model are built
        checkpoint = config.checkpoint
        if checkpoint.dirpath is None:
            checkpoint.dirpath = os.path.join(run_dir, "checkpoints")
        if self.subcommand == "fit" and is_local_path(str(checkpoint.dirpath)):
            check_creatable_dir(Path(checkpoint.dirpath), "--checkpoint.dirpath")  # before training
        if checkpoint.monitor is None:
            task = get_task(data_task(config.data))
            checkpoint.monitor, checkpoint.mode = task.monitor, task.mode
            if checkpoint.filename is None:
                checkpoint.filename = (f"epoch={{epoch}}-step={{step}}-val_{task.metric_name}="
                                       f"{{{task.monitor}:.4f}}")
        if self.subcommand is not None:  # before any data is read
            config.ckpt_path = check_run_dir(checkpoint.dirpath, config.get("ckpt_path"),
                                             checkpoint.overwrite, self.subcommand == "fit")
            if config.ckpt_path == "best":
                config.ckpt_path = best_checkpoint_in(str(checkpoint.dirpath), checkpoint.monitor)
            ckpt_path = config.ckpt_path
            if (ckpt_path and is_local_path(ckpt_path)
                    and ckpt_path.split(":")[0] not in LIGHTNING_CKPT_NAMES):
                self._read_checkpoint(ckpt_path)  # a missing, damaged or crafted file: one line now
        if config.trainer.logger in (None, True):
            # a resumed fit logs into the version folder it started in, not a new one
            resumed = self.subcommand == "fit" and bool(config.get("ckpt_path"))
            config.trainer.logger = [
                Namespace(class_path=cls, init_args=Namespace(
                    save_dir=run_dir, name=name,
                    version=newest_version(Path(run_dir) / name) if resumed else None))
                for cls, name in (("lightning.pytorch.loggers.TensorBoardLogger", TENSORBOARD_LOGS),
                                  (f"{RunCSVLogger.__module__}.RunCSVLogger", CSV_LOGS))
            ]


def check_kernel_installed(config: Namespace) -> None:
    """``ValueError`` (one line) for the Triton attention kernel where triton is not installed."""
    backbone = (config.get("model") or Namespace()).get("backbone")
    impl = backbone.get("attention_impl") if isinstance(backbone, (Namespace, dict)) else None
    missing = missing_extra("triton", f"--model.backbone.attention_impl {impl}") if impl == "triton" else None
    if missing:
        raise ValueError(missing)


def best_checkpoint_in(dirpath: str, monitor: str) -> str:
    """``--ckpt_path best``: the best ``monitor`` checkpoint that ``dirpath``'s ``last.ckpt``
    records, by name in that folder (a copied run directory gives its own); else one-line ``ValueError``."""
    if not is_local_path(dirpath):
        raise ValueError(f"--ckpt_path best reads {LAST} of a local --checkpoint.dirpath, not {dirpath}: give "
                         "the checkpoint's path")
    last = Path(dirpath) / LAST
    if not last.is_file():
        raise ValueError(f"--ckpt_path best: {dirpath} holds no {LAST}, which records the run's best checkpoint; "
                         "train first, or give --ckpt_path PATH")
    best, _ = recorded_best(Path(dirpath), monitor, read_checkpoint(last))
    if best is None:
        raise ValueError(f"--ckpt_path best: {last} records no best {monitor} checkpoint (no validation has run); "
                         "give --ckpt_path last or PATH")
    if not best.is_file():
        raise ValueError(f"--ckpt_path best: the best checkpoint {best.name} that {last} records is not in "
                         f"{dirpath}; copy it there, or give --ckpt_path PATH")
    return str(best)


def data_task(data: Namespace) -> str:
    """The task the configured DataModule links into the model: its ``task`` argument, else its class's."""
    task = (data.get("init_args") or Namespace()).get("task")
    if task is None and data.get("class_path"):
        module, _, name = data.class_path.rpartition(".")
        task = getattr(getattr(importlib.import_module(module), name), "task", None)
    return task or "regression"


class _DropLightningTips(logging.Filter):
    """Lightning's advertisements for its cloud products ("💡 Tip: ...") are not run output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def configure_logging() -> None:
    """This package's INFO messages on stderr; Lightning keeps its own handler, without tips."""
    logging.basicConfig(format="%(message)s")  # no-op where the application configured logging
    logging.getLogger("graphormer_urpe").setLevel(logging.INFO)
    if not any(isinstance(f, _DropLightningTips) for f in rank_zero_module.log.filters):
        rank_zero_module.log.addFilter(_DropLightningTips())


def build_cli(args: list[str] | None = None, run: bool = True) -> GraphormerCLI:
    configure_logging()
    # `--config NAME` reads the packaged recipe; `recipes [NAME]` lists them (exits here)
    if args is None:  # LightningCLI warns when given both args and a command line: edit argv
        sys.argv[1:] = command_line(sys.argv[1:])
    elif isinstance(args, (list, tuple)):
        args = command_line(list(args))
    config_help = "--config takes a file or a packaged recipe's name (graphormer-urpe recipes lists them)"
    # a fit holds its run directory while it runs; Lightning's warning that a loader without a
    # state_dict cannot resume inside an epoch is not true of these: their order and place come
    # from the trainer's epoch and batch count (SeededShuffleSampler)
    with run_dirs_released_after(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        return GraphormerCLI(
            GraphormerModule,
            pl.LightningDataModule,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": f"Graphormer + URPE training (LightningCLI). {config_help}.",
                           **{name: {"description": help, "epilog": f"{config_help}."}
                              for name, help in SUBCOMMAND_HELP.items()}},
            args=args,
            run=run,
        )
