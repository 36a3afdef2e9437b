"""``graphormer-urpe {fit,validate,test,predict}``: LightningCLI over the module and the datamodules.

Facts that belong to the data (:class:`~graphormer_urpe.data.facts.DataFacts`: vocabulary sizes,
number of targets, ``max_hops``, the widths of its optional node encodings, the task and the
featurizer) are linked from the instantiated DataModule into the model as one object, so a
config names each of them once, on the data. A run's outputs all go under
``trainer.default_root_dir``: TensorBoard and CSV logs, ``checkpoints/`` with the best model by the task's validation metric
(``epoch=…-step=…-val_<metric>=….ckpt``: ``val_mae``, ``val_auroc``, ``val_accuracy``) plus ``last.ckpt``, always the run's newest state (resume
a killed or finished run with ``--ckpt_path last``; :mod:`~graphormer_urpe.training.run_checkpoint`),
and for ``predict`` the predictions (``predictions.csv``, or ``--prediction_writer.output``).
A ``fit`` into a run directory that already holds checkpoints is refused unless it resumes
(``--ckpt_path last``) or starts over (``--checkpoint.overwrite true``).

The backbone is typed (:class:`~graphormer_urpe.nn.graphormer.GraphormerConfig`), so partial
overrides merge in any order: ``--model.backbone '{"num_layers": 4}'``,
``--model.backbone.attention rpe`` or a config overlay that sets one key.
"""
from __future__ import annotations

import errno
import importlib
import linecache
import logging
import os
import signal
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import BasePredictionWriter, GradientAccumulationScheduler, LearningRateMonitor
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_module, rank_zero_only

from graphormer_urpe.data.dataset import check_seed
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.utils.files import check_creatable_dir, check_writable_dir, same_file
from graphormer_urpe.utils.torch_files import read_checkpoint
from graphormer_urpe.prediction.model import RETIRED_HPARAMS
from graphormer_urpe.utils.lightning_private import is_local_path
from graphormer_urpe.training.run_checkpoint import (RunCheckpoint, check_run_dir, hold_run_dir,
                                                      pending_stop, run_dirs_released_after)
from graphormer_urpe.training.module import DATA_POSITION, GraphormerModule, data_position
from graphormer_urpe.training.recipes import command_line
from graphormer_urpe.training.schedule import schedule_lengths
from graphormer_urpe.data.task import get_task

DEFAULT_RUN_DIR = "runs/default"
#: ``--ckpt_path`` values that Lightning resolves itself (``last`` is resolved here).
LIGHTNING_CKPT_NAMES = ("best", "hpc", "registry")  # also registry:<name>
PREDICTIONS_FILE = "predictions.csv"
PACKAGE_DIR = Path(__file__).resolve().parents[1]


class PredictionWriter(BasePredictionWriter):
    """Writes ``predict``'s outputs to a CSV with the columns of ``graphormer-urpe-predict``
    (``row, smiles, prediction_<target>..., error``), in the order of the predict split.

    Args:
        output: the CSV (default: ``<trainer.default_root_dir>/predictions.csv``).
    """

    def __init__(self, output: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output = output

    def write_on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           predictions, batch_indices) -> None:
        from graphormer_urpe.prediction.table import InputRow, prediction_columns, write_predictions

        outputs = [o for per_loader in _per_dataloader(predictions) for o in per_loader]
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


def _per_dataloader(predictions) -> list[list]:
    """Lightning returns a flat list for one predict loader and a list of lists for several."""
    if predictions and isinstance(predictions[0], list):
        return predictions
    return [predictions]


class GraphormerCLI(LightningCLI):
    def _parse_ckpt_path(self) -> None:
        """As LightningCLI's: with ``--ckpt_path FILE`` the checkpoint's hyperparameters become
        the model's arguments, except the facts (either form, :meth:`DataFacts.nest`): those
        are linked from the data, not options of the model."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        hparams = {k: v for k, v in DataFacts.nest(self._checkpoint_hparams(ckpt_path)).items()
                   if k not in ("facts", "_instantiator", "_class_path", *RETIRED_HPARAMS)}
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

    def _checkpoint_hparams(self, ckpt_path: str) -> dict:
        """The hyperparameters of the checkpoint the command starts from, read once (as plain
        data: :func:`~graphormer_urpe.utils.torch_files.read_checkpoint`, which refuses a
        damaged or crafted file in one line)."""
        return self._read_checkpoint(ckpt_path)[1]

    def _read_checkpoint(self, ckpt_path: str) -> tuple[str, dict, dict]:
        """``(path, hyperparameters, where it stands in its epoch)`` of the checkpoint the
        command starts from, read once (:func:`~graphormer_urpe.utils.torch_files.read_checkpoint`)."""
        cached = getattr(self, "_checkpoint", None)
        if cached is None or cached[0] != ckpt_path:
            checkpoint = read_checkpoint(ckpt_path)
            checkpoint = checkpoint if isinstance(checkpoint, dict) else {}
            hparams = checkpoint.get("hyper_parameters")
            self._checkpoint = cached = (ckpt_path, hparams if isinstance(hparams, dict) else {},
                                         epoch_place(checkpoint))
        return cached

    def after_instantiate_classes(self) -> None:
        """Before any data is read or built: the checkpoint the command starts from was trained
        on data of this kind (:func:`check_checkpoint_data`). A run without a logger
        (``--trainer.logger false``) drops the learning-rate monitor, which has nothing to log
        to (Lightning would stop the run on it once the data is built)."""
        if self.trainer is not None and not self.trainer.loggers:
            self.trainer.callbacks = [c for c in self.trainer.callbacks if not isinstance(c, LearningRateMonitor)]
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("ckpt_path") and Path(config.ckpt_path).is_file():
            path, hparams, place = self._read_checkpoint(config.ckpt_path)
            check_checkpoint_data(path, hparams, self.model)
            check_checkpoint_model(path, hparams, self.model)
            scheduled = any(isinstance(c, GradientAccumulationScheduler) for c in self.trainer.callbacks)
            if self.subcommand == "fit" and not scheduled:  # a scheduler's factor depends on the epoch
                check_epoch_place(path, place, data_position(self.trainer, self.datamodule))

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
            task = get_task(_data_task(config.data))
            checkpoint.monitor, checkpoint.mode = task.monitor, task.mode
            if checkpoint.filename is None:
                checkpoint.filename = (f"epoch={{epoch}}-step={{step}}-val_{task.metric_name}="
                                       f"{{{task.monitor}:.4f}}")
        if self.subcommand is not None:  # before any data is read
            config.ckpt_path = check_run_dir(checkpoint.dirpath, config.get("ckpt_path"),
                                             checkpoint.overwrite, self.subcommand == "fit")
            ckpt_path = config.ckpt_path
            if (ckpt_path and is_local_path(ckpt_path)
                    and ckpt_path.split(":")[0] not in LIGHTNING_CKPT_NAMES):
                self._checkpoint_hparams(ckpt_path)  # a missing, damaged or crafted file: one line now
        if config.trainer.logger in (None, True):
            config.trainer.logger = [
                Namespace(class_path=f"lightning.pytorch.loggers.{cls}",
                          init_args=Namespace(save_dir=run_dir, name=name))
                for cls, name in (("TensorBoardLogger", "tensorboard"), ("CSVLogger", "csv"))
            ]


def _data_task(data: Namespace) -> str:
    """The task the configured DataModule will link into the model: its ``task`` init
    argument, else its class's ``task`` attribute."""
    task = (data.get("init_args") or Namespace()).get("task")
    if task is None and data.get("class_path"):
        module, _, name = data.class_path.rpartition(".")
        task = getattr(getattr(importlib.import_module(module), name), "task", None)
    return task or "regression"


def check_checkpoint_data(ckpt_path: str, saved: dict, model: GraphormerModule) -> None:
    """``ValueError`` (one line) naming each way the checkpoint's recorded data (its task,
    featurizer, target columns, number of targets) differs from the data the model was built
    for: its head would be read as another task's or another column's, or its weights would not
    fit. What a checkpoint does not record is not checked."""
    recorded = DataFacts.nest(saved)["facts"]
    ours = model.facts.as_dict()
    theirs_and_ours = [(name, recorded.get(name), ours[name]) for name in ("task", "featurizer", "num_targets")]
    theirs_and_ours.append(("target columns", saved.get("target_names"), model.hparams.get("target_names")))
    differences = [f"{name} {theirs!r}, the data's {current!r}" for name, theirs, current in theirs_and_ours
                   if theirs is not None and current is not None and _plain(theirs) != _plain(current)]
    if differences:
        raise ValueError(f"--ckpt_path {ckpt_path} was trained on other data (checkpoint's "
                         f"{'; '.join(differences)}): use a checkpoint of this data, or configure "
                         "the data it was trained on")


#: Backbone fields that decide the shapes of its parameters (the others, dropouts and the
#: attention kernel, may change when a run resumes).
SHAPE_FIELDS = ("num_layers", "hidden_dim", "ffn_dim", "num_heads", "attention", "share_urpe_scale",
                "max_degree", "max_spd")


def check_checkpoint_model(ckpt_path: str, saved: dict, model: GraphormerModule) -> None:
    """``ValueError`` (one line, before any data is read) naming each backbone field whose value
    differs between the checkpoint and the model the options build: its weights would not load."""
    theirs, ours = saved.get("backbone"), model.hparams.get("backbone")
    if not isinstance(theirs, dict) or not isinstance(ours, dict):
        return
    differences = [f"{name} {theirs[name]!r}, this run's {ours[name]!r}" for name in SHAPE_FIELDS
                   if name in theirs and name in ours and theirs[name] != ours[name]]
    if differences:
        raise ValueError(f"--ckpt_path {ckpt_path} holds another model (checkpoint's {'; '.join(differences)}): "
                         "drop the --model options that change it, or start a new run")


def epoch_place(checkpoint: dict) -> dict:
    """Where a checkpoint stands in its epoch: the batches done (``batches``) and their unit
    (``position``, :func:`~.module.data_position`; None where it does not record one)."""
    try:
        batches = int(checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"])
    except (KeyError, TypeError, ValueError):
        batches = 0
    return {"batches": batches, "position": checkpoint.get(DATA_POSITION)}


def check_epoch_place(ckpt_path: str, place: dict, ours: dict) -> None:
    """``ValueError`` (one line, before any data is read) when a checkpoint saved inside an epoch
    counted its batches in another unit than this run would: another global batch (processes x
    batch size x accumulation) or another accumulation would continue the epoch's order at
    another graph. The number of processes may change with the batch size (2 x 128 = 1 x 256)."""
    saved = place.get("position")
    if not place.get("batches") or not isinstance(saved, dict) or saved == ours:
        return
    raise ValueError(
        f"--ckpt_path {ckpt_path} stopped inside an epoch after {place['batches']} batches of a global batch of "
        f"{saved.get('global_batch')} graphs with accumulate_grad_batches {saved.get('accumulate')}; this run "
        f"has {ours['global_batch']} with {ours['accumulate']}: resume with the same global batch "
        "(processes x data.init_args.batch_size x trainer.accumulate_grad_batches) and accumulation")


def _plain(value):
    """Lists and tuples compare alike (a checkpoint stores lists, a config may give tuples)."""
    return list(value) if isinstance(value, (list, tuple)) else value


def check_schedule_config(config: Namespace) -> None:
    """The learning-rate schedule's checks (:func:`~.schedule.check_schedule`) on the parsed
    config, with ``trainer.max_steps`` standing in for an unset ``model.total_steps``: a bad
    schedule is refused before the data is built, not at the first optimizer step."""
    model, max_steps = config.model, config.trainer.get("max_steps")
    if max_steps is not None and (max_steps == 0 or max_steps < -1):
        raise ValueError(f"trainer.max_steps must be >= 1, or -1 for no limit, got {max_steps}")
    # A fraction of a length known only once the data is built counts as no warmup here.
    schedule_lengths(model.lr, model.end_lr, model.warmup_steps, model.get("warmup_fraction"),
                     model.get("total_steps"), max_steps if max_steps is not None and max_steps > 0 else None,
                     "trainer.max_steps")


#: ``trainer.precision`` values the training step serves: float32 weights and optimizer moments
#: (``16-true`` / ``bf16-true`` would keep them in half precision and train another model).
STEP_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16", "16-mixed", "16", "64-true", "64")
#: ``trainer.strategy`` names the training step serves (one process, or DDP's processes).
STEP_STRATEGIES = ("auto", "ddp", "ddp_find_unused_parameters_false", "ddp_find_unused_parameters_true")


def check_step_config(trainer: Namespace) -> None:
    """The trainer settings that the one training step (:mod:`~.engine`) does not do, refused in
    one line before any data is read: weights or optimizer moments in half precision
    (``16-true``, ``bf16-true``, ``transformer-engine``), strategies other than one process or DDP
    (FSDP, DeepSpeed, spawned processes), clipping by value, and device counts that Lightning
    would refuse with a traceback once the trainer is built (:meth:`TrainingEngine.unsupported
    <.engine.TrainingEngine.unsupported>` checks the built trainer again)."""
    problems = []
    precision = trainer.get("precision")
    if precision is not None and str(precision) not in STEP_PRECISIONS:
        problems.append(f"trainer.precision 32-true, bf16-mixed or 16-mixed (got {precision}: the step keeps "
                        "float32 weights and optimizer moments)")
    strategy = trainer.get("strategy")
    if isinstance(strategy, str) and strategy not in STEP_STRATEGIES:
        problems.append(f"trainer.strategy ddp or auto (got {strategy}: the step averages the gradients of "
                        "DDP's processes itself; sharded or spawned strategies it does not serve)")
    if trainer.get("gradient_clip_val") and trainer.get("gradient_clip_algorithm") not in (None, "norm"):
        problems.append(f"trainer.gradient_clip_algorithm norm (got {trainer.gradient_clip_algorithm})")
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1):
        problems.append(f"trainer.accumulate_grad_batches an integer >= 1 (got {accumulate})")
    problems += device_problems(trainer)
    if problems:
        raise ValueError("the training step needs " + "; ".join(problems))


def device_number(devices) -> int | None:
    """``trainer.devices`` given as one integer (``3``, ``"3"``, ``-1``), else None (a list of
    device ids, ``auto``)."""
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        return int(devices)
    return None


def device_count(trainer: Namespace) -> int:
    """The processes ``trainer.devices`` x ``trainer.num_nodes`` start (1 where it says ``auto``)."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    count = device_number(devices)
    if count == -1:
        count = torch.cuda.device_count()
    elif count is None and isinstance(devices, (list, tuple)):
        count = len(devices)
    elif count is None and isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    return max(count or 1, 1) * (nodes if isinstance(nodes, int) else 1)


def device_problems(trainer: Namespace) -> list[str]:
    """``trainer.devices`` and ``trainer.num_nodes`` that Lightning refuses with a traceback: on a
    CPU a number of processes (an integer >= 1); anywhere, at least one device and one node."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes")
    problems = []
    if nodes is not None and (not isinstance(nodes, int) or nodes < 1):
        problems.append(f"trainer.num_nodes >= 1 (got {nodes})")
    if devices in (None, "auto"):
        return problems
    accelerator = trainer.get("accelerator")
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())
    count = device_number(devices)
    if on_cpu and (count is None or count < 1):
        problems.append(f"trainer.devices a number of processes >= 1 on a CPU (got {devices}: lists of "
                        "device ids and -1 are for GPUs)")
    elif count == 0 or (isinstance(devices, (list, tuple)) and not devices):
        problems.append(f"trainer.devices at least one device (got {devices})")
    return problems


def check_prediction_output(config: Namespace, config_files: list) -> None:
    """``predict``'s output (``prediction_writer.output``, else ``predictions.csv`` in the run
    directory) is never a file the run reads: a config file, the checkpoint, a data file, any
    existing file an option names (also through a symbolic or hard link). Checked before the
    data and the model are built."""
    output = config.prediction_writer.output or os.path.join(config.trainer.default_root_dir, PREDICTIONS_FILE)
    if not os.path.isfile(output):
        return
    named = [("--config", getattr(path, "absolute", path)) for path in config_files]
    for key, value in config.items():
        if key in ("config", "prediction_writer.output"):
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, (str, os.PathLike)):
                named.append((f"--{key}", item))
    for option, path in named:
        if os.path.isfile(path) and same_file(path, output):
            raise ValueError(f"--prediction_writer.output {output} is the file of {option} ({path}): "
                             "the predictions would overwrite it; choose another output")


def input_error(error: BaseException) -> Exception | None:
    """The ``ValueError`` this package raised about bad input (an option, a file), or Lightning's
    ``MisconfigurationException`` about its own options, if ``error`` is one or wraps one. jsonargparse wraps an error raised while instantiating a subclass (the
    DataModule) in its own "Does not validate against any of the Union subtypes" error; the
    cause chain leads back to ours. Other errors are bugs, not input errors: they keep their
    traceback."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ValueError) and _raised_in_package(error):
            return error
        if isinstance(error, MisconfigurationException):  # Lightning's word on its own options
            return error
        error = error.__cause__ or error.__context__
    return None


def _raised_in_package(error: BaseException) -> bool:
    """Whether a ``raise`` statement of this package raised ``error`` (not a library call made
    from it, e.g. a numpy ``reshape``: that is a bug, which keeps its traceback)."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    return (Path(filename).resolve().is_relative_to(PACKAGE_DIR)
            and linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise "))


class _DropLightningTips(logging.Filter):
    """Lightning's advertisements for its cloud products ("💡 Tip: ...") are not run output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def configure_logging() -> None:
    """This package's INFO messages (dataset builds: "encoding N graphs", rejected rows,
    schedule warnings) on stderr; Lightning keeps its own handler; no Lightning tips."""
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
                           **{name: {"epilog": f"{config_help}."} for name in ("fit", "validate", "test", "predict")}},
            args=args,
            run=run,
        )


def main(args: list[str] | None = None) -> int:
    """The command: exit status 0, 2 for refused input (one line naming the option or file, as
    argparse does), 1 for a diverged run or a full disk, 128 + the signal for a fit stopped by
    SIGTERM or Ctrl-C (one line from the first process of a multi-process run)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    pending_stop()  # a signal of an earlier fit in this process (built without main) is not this one's
    try:
        build_cli(args)
    except SIGTERMException:  # raised after the step in progress, which last.ckpt then holds
        return stopped(pending_stop() or signal.SIGTERM, during_training=True)
    except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C; Lightning's trainer makes it sys.exit(1)
        if isinstance(exc, SystemExit) and not isinstance(exc.__context__, KeyboardInterrupt):
            raise
        pending_stop()
        print("graphormer-urpe: stopped by Ctrl-C (SIGINT); the checkpoints already written are whole "
              "(a fit resumes from its last.ckpt with --ckpt_path last)", file=sys.stderr)
        return 128 + signal.SIGINT
    except FloatingPointError as exc:  # a diverged run: say why, without a traceback
        print(f"graphormer-urpe: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"graphormer-urpe: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        refused = input_error(exc)
        if refused is None:
            raise
        print(f"graphormer-urpe: error: {refused}", file=sys.stderr)
        return 2
    signum = pending_stop()
    return stopped(signum, during_training=False) if signum else 0


def stopped(signum: int, during_training: bool) -> int:
    """Say (once per run: on its first process) how a signal stopped the command; its exit status."""
    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    if during_training:
        said = ("after the step in progress; a fit's checkpoints/last.ckpt holds that step (on every "
                "process): resume with --ckpt_path last")
    else:
        said = "after its training had ended; its checkpoints are complete"
    if rank_zero_only.rank == 0:
        print(f"graphormer-urpe: stopped by {name} {said}", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
