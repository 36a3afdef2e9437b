"""The refusals of a ``graphormer-urpe`` configuration before any data is read, each one line
naming the option or file (:class:`~graphormer_urpe.training.lightning_cli.GraphormerCLI` calls them)."""
from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.training.module import DATA_POSITION, GraphormerModule
from graphormer_urpe.training.schedule import schedule_lengths
from graphormer_urpe.utils.files import same_file
from graphormer_urpe.utils.lightning_private import spawn_start_method

#: ``predict``'s table in the run directory, unless ``--prediction_writer.output`` names another.
PREDICTIONS_FILE = "predictions.csv"


def check_checkpoint_data(ckpt_path: str, saved: dict, model: GraphormerModule) -> None:
    """``ValueError`` naming each way the checkpoint's recorded data (task, featurizer, targets)
    differs from the model's: its head would be read as another's, or would not fit."""
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
                "max_degree", "max_spd", "readout")


def check_checkpoint_model(ckpt_path: str, saved: dict, model: GraphormerModule) -> None:
    """``ValueError`` naming each backbone field in which the checkpoint and the model differ."""
    theirs, ours = saved.get("backbone"), model.hparams.get("backbone")
    if not isinstance(theirs, dict) or not isinstance(ours, dict):
        return
    differences = [f"{name} {theirs[name]!r}, this run's {ours[name]!r}" for name in SHAPE_FIELDS
                   if name in theirs and name in ours and theirs[name] != ours[name]]
    if differences:
        raise ValueError(f"--ckpt_path {ckpt_path} holds another model (checkpoint's {'; '.join(differences)}): "
                         "drop the --model options that change it, or start a new run")


def epoch_place(checkpoint: dict) -> dict:
    """Where a checkpoint stands in its epoch: ``batches`` done, and their unit ``position``
    (:func:`~.module.data_position`)."""
    try:
        batches = int(checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"])
    except (KeyError, TypeError, ValueError):
        batches = 0
    return {"batches": batches, "position": checkpoint.get(DATA_POSITION)}


def check_epoch_place(ckpt_path: str, place: dict, ours: dict) -> None:
    """``ValueError`` when a checkpoint saved inside an epoch counted its batches in another unit
    than this run would (it would continue at another graph); the number of processes may change
    with the batch size (2 x 128 = 1 x 256)."""
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
    """The schedule's checks on the parsed config, ``trainer.max_steps`` standing in for an unset
    ``model.total_steps``: refused before the data is built, not at the first step."""
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
    """The trainer options that the training step (:mod:`~.engine`) does not serve: half-precision
    weights, strategies other than one process or DDP, clipping by value, and device counts that
    Lightning would refuse with a traceback once the trainer is built."""
    problems = []
    precision = trainer.get("precision")
    if precision is not None and str(precision) not in STEP_PRECISIONS:
        problems.append(_precision_needed(precision))
    strategy = trainer.get("strategy")
    if isinstance(strategy, str) and strategy not in STEP_STRATEGIES:
        problems.append(_strategy_needed(strategy))
    if trainer.get("gradient_clip_val") and trainer.get("gradient_clip_algorithm") not in (None, "norm"):
        problems.append(f"trainer.gradient_clip_algorithm norm (got {trainer.gradient_clip_algorithm})")
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1):
        problems.append(f"trainer.accumulate_grad_batches an integer >= 1 (got {accumulate})")
    problems += device_problems(trainer)
    if problems:
        raise ValueError("the training step needs " + "; ".join(problems))


def _precision_needed(got) -> str:
    return (f"trainer.precision 32-true, bf16-mixed or 16-mixed (got {got}: the step keeps float32 weights "
            "and optimizer moments)")


def _strategy_needed(got) -> str:
    return (f"trainer.strategy ddp or auto (got {got}: the step averages the gradients of DDP's processes "
            "itself; sharded or spawned strategies it does not serve)")


#: The environment variables by which processes started by hand on several machines find each
#: other (Lightning's ``LightningEnvironment``); a cluster's launcher (SLURM, torchrun, ...) has its own.
NODE_VARIABLES = ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK")


def check_trainer(trainer: pl.Trainer, options: Namespace, subcommand: str) -> None:
    """The built trainer's settings that :func:`check_step_config` cannot see in the options: a
    half-precision plugin, a strategy class whose processes are spawned, ``16-mixed`` that
    Lightning would run as ``bf16-mixed`` (a CPU), and ``num_nodes`` above 1 where nothing starts
    the other nodes (the first would wait 30 minutes)."""
    plugin, strategy = trainer.precision_plugin, trainer.strategy
    start_method = spawn_start_method(strategy)
    spawned = f"{type(strategy).__name__} with start_method {start_method!r}"
    step_problems = []
    if subcommand == "fit" and not (type(plugin) is Precision or isinstance(plugin, (MixedPrecision, DoublePrecision))):
        step_problems.append(_precision_needed(f"{type(plugin).__name__} {trainer.precision}"))
    if subcommand == "fit" and start_method is not None:
        step_problems.append(_strategy_needed(spawned))
    if step_problems:
        raise ValueError("the training step needs " + "; ".join(step_problems))
    if start_method is not None:
        raise ValueError(f"{subcommand} needs trainer.strategy ddp or auto (got {spawned}: the command's "
                         "configuration does not pickle into spawned processes)")
    asked = options.get("precision")
    if str(asked) in ("16-mixed", "16") and trainer.precision != "16-mixed":
        raise ValueError(f"trainer.precision {asked} needs a CUDA GPU: here Lightning would run "
                         f"{trainer.precision} instead; give --trainer.precision {trainer.precision} (or 32-true)")
    environment = getattr(strategy, "cluster_environment", None)
    if (trainer.num_nodes > 1 and type(environment) is LightningEnvironment
            and not any(os.environ.get(name) for name in NODE_VARIABLES)):
        raise ValueError(f"trainer.num_nodes {trainer.num_nodes} needs the other nodes' processes, which "
                         "nothing starts here: run it under a cluster's launcher (SLURM, torchrun, ...) or "
                         f"with {' and '.join(NODE_VARIABLES[:2])} set on each node; on one machine give "
                         "--trainer.num_nodes 1 and --trainer.devices N")


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
    """``trainer.devices`` and ``trainer.num_nodes`` that Lightning refuses with a traceback."""
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
    """``predict``'s output is never a file the run reads: a config file or any existing file an
    option names (also through a link)."""
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
