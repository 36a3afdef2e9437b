"""A model from a checkpoint, verified before use: :func:`load_module` reads a Lightning
checkpoint with :func:`~graphormer_urpe.utils.torch_files.read_checkpoint` (plain data, zip
CRCs checked), then checks that its weights are finite, that its hyperparameters build this
version's model for their featurizer and task, and that the model predicts a probe molecule; any
failure is a :class:`~graphormer_urpe.utils.torch_files.CheckpointError` naming the file.

:func:`best_checkpoint` finds a run directory's best-validation checkpoint, and
:func:`checkpoint_files` turns what a user names as checkpoints (files, run directories, or a
folder of runs such as an ablation grid or an ensemble's members) into checkpoint files, and
:func:`load_models` makes them one model to predict with.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from graphormer_urpe.utils.torch_files import CheckpointError, read_checkpoint
from graphormer_urpe.utils.workers import ran_out_of_memory
from graphormer_urpe.prediction.model import ModelEnsemble, predict_smiles
from graphormer_urpe.prediction.table import InputRow

#: Where a run directory keeps its checkpoints, and the newest state among them.
RUN_LAST_CHECKPOINT = Path("checkpoints") / "last.ckpt"

#: Options that no longer exist but that checkpoints may record (``cuda_graphs``, ``engine``: how
#: steps ran, not what was trained); dropped by :func:`checkpoint_arguments`.
RETIRED_HPARAMS = frozenset({"cuda_graphs", "engine"})


#: A molecule every featurizer accepts: a loaded model must predict it (hand-edited checkpoints).
_PROBE_SMILES = "CCO"


def check_finite(ckpt: Path, state_dict: dict) -> None:
    """:class:`CheckpointError` naming the tensors of ``state_dict`` that hold NaN or inf."""
    bad = [name for name, value in state_dict.items()
           if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all()]
    if bad:
        raise CheckpointError(f"checkpoint {ckpt} has non-finite weights (NaN or inf) in {len(bad)} "
                              f"tensor(s): {', '.join(bad[:5])}")


def checkpoint_arguments(hyper_parameters: dict) -> dict:
    """The arguments of ``GraphormerModule`` that a checkpoint's hyperparameters give, as both
    ``graphormer-urpe-predict`` (:func:`load_module`) and LightningCLI's ``--ckpt_path`` read
    them: the facts as one ``facts`` dict (either form, :meth:`DataFacts.nest`), without
    Lightning's own keys and the options since retired (``RETIRED_HPARAMS``)."""
    from graphormer_urpe.data.facts import DataFacts

    return {name: value for name, value in DataFacts.nest(hyper_parameters).items()
            if name not in ("_instantiator", "_class_path", *RETIRED_HPARAMS)}


def load_module(ckpt: str | Path, map_location: str = "cpu", *, model_class: type | None = None):
    """The verified model stored in a Lightning checkpoint, in eval mode: a
    :class:`~graphormer_urpe.prediction.model.PredictionModel` (Lightning is not imported), or
    ``model_class`` built from the same hyperparameters and weights
    (:func:`graphormer_urpe.training.module.load_training_module` gives the
    ``GraphormerModule`` itself, with the same ``model``, ``hparams`` and ``predict_step``).

    Raises :class:`CheckpointError` for a missing file, a damaged archive (zip CRCs), content
    that is not plain data, non-finite weights, and hyperparameters or weights that do not build
    this version's model.
    """
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.data.feature_ids import num_embeddings
    from graphormer_urpe.data.featurize import featurizer_spec
    from graphormer_urpe.data.task import get_task

    if model_class is None:
        from graphormer_urpe.prediction.model import PredictionModel as model_class

    ckpt = Path(ckpt)
    checkpoint = read_checkpoint(ckpt, map_location)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict) \
            or not isinstance(checkpoint.get("hyper_parameters"), dict):
        raise CheckpointError(f"{ckpt} is not a Lightning checkpoint (no state_dict/hyper_parameters)")
    check_finite(ckpt, checkpoint["state_dict"])
    if not any(key.startswith("model.") for key in checkpoint["state_dict"]):
        # an exported backbone (graphormer_urpe.cli.export): the backbone's own names
        checkpoint["state_dict"] = {f"model.{k}": v for k, v in checkpoint["state_dict"].items()}
    hparams = checkpoint_arguments(checkpoint["hyper_parameters"])
    hparams["compile"] = False  # inference needs no compile warm-up, whatever training used
    hparams["init_from"] = None  # its weights are in this checkpoint; the file may be gone
    try:
        facts = DataFacts.of_hparams(hparams)
        spec = featurizer_spec(facts.featurizer)
        get_task(facts.task)
        for kind, dims in (("atom", spec.atom_feature_dims), ("bond", spec.bond_feature_dims)):
            if getattr(facts, f"num_{kind}_embeddings") != num_embeddings(dims):
                raise ValueError(f"num_{kind}_embeddings={getattr(facts, f'num_{kind}_embeddings')!r} but "
                                 f"featurizer {spec.name!r} needs {num_embeddings(dims)}")
        module = model_class(**hparams)
        module.load_state_dict(checkpoint["state_dict"])
        module.eval()
        predict_smiles(module, [InputRow(_PROBE_SMILES)], max_nodes=8, batch_size=1)
    except Exception as exc:  # noqa: BLE001 - hand-edited hyperparameters fail in many ways
        if ran_out_of_memory(exc):  # the machine's limit, not the checkpoint's fault
            raise
        raise CheckpointError(f"checkpoint {ckpt} does not match this version's GraphormerModule "
                              f"({type(exc).__name__}: {exc})") from None
    return module


def load_models(ckpts: Sequence[str | Path]):
    """The verified inference model (:func:`load_module`) of one checkpoint, or the
    :class:`~graphormer_urpe.prediction.model.ModelEnsemble` of several (their mean, and their
    spread as a ``std``), each named by its path in errors."""
    models = [load_module(ckpt) for ckpt in ckpts]
    return models[0] if len(models) == 1 else ModelEnsemble(models, list(map(str, ckpts)))


def model_checkpoint_state(checkpoint: dict, monitor: str | None = None) -> dict | None:
    """The state that a run's ``ModelCheckpoint`` (or ``RunCheckpoint``, which saves under the same
    key) stored in the Lightning ``checkpoint`` (read by ``read_checkpoint``): its
    ``best_model_path``, ``best_model_score``, ``monitor``, ... The one that monitors ``monitor``
    (any, if None), or None when there is none. Lightning keys a callback's state by its class
    name followed by its arguments (``ModelCheckpoint{'monitor': 'val/mae', ...}``), hence the
    prefix."""
    return next((state for key, state in checkpoint.get("callbacks", {}).items()
                 if key.startswith("ModelCheckpoint") and (monitor is None or state.get("monitor") == monitor)),
                None)


def recorded_best(checkpoint_dir: Path, monitor: str, last: dict) -> tuple[Path | None, float | None]:
    """The best ``monitor`` checkpoint that ``last`` (the ``last.ckpt`` of ``checkpoint_dir``)
    records, and its score; ``(None, None)`` where it records none (no validation has run). The
    file is looked up by name in ``checkpoint_dir`` only: the recorded path is where the run was
    trained, and a copied or moved run folder must not silently use the original's checkpoint.
    The caller says what a missing file means."""
    state = model_checkpoint_state(last, monitor)
    if not state or not state.get("best_model_path"):
        return None, None
    return Path(checkpoint_dir) / Path(state["best_model_path"]).name, float(state["best_model_score"])


def _recorded_best(run_dir: Path):
    """``(best path, its validation score, last step, the task)`` of a run directory, from the
    ModelCheckpoint state its ``checkpoints/last.ckpt`` carries, without reading the best file
    itself (:func:`best_checkpoint`)."""
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.data.task import get_task

    run_dir = Path(run_dir)
    last = read_checkpoint(run_dir / RUN_LAST_CHECKPOINT)
    task = get_task(DataFacts.recorded(last.get("hyper_parameters", {}), "task"))
    path, score = recorded_best(run_dir / RUN_LAST_CHECKPOINT.parent, task.monitor, last)
    if path is None:
        raise CheckpointError(f"{run_dir}: last.ckpt has no best {task.monitor} checkpoint (was "
                              "validation run? the budget must cover at least one validation)")
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: its best checkpoint {path.name} (recorded in {RUN_LAST_CHECKPOINT}) "
                              f"is missing from {path.parent}; copy it there, or name a checkpoint file")
    return path, score, int(last["global_step"]), task


def best_checkpoint(run_dir: Path):
    """``(best path, its validation score, its step, last step, the task)`` of a run directory,
    from the ModelCheckpoint state its ``checkpoints/last.ckpt`` carries (the CLI's checkpoint
    callback monitors the task's validation metric, e.g. ``val/mae``). The best file is looked up
    by name in the run's own ``checkpoints/`` first, so a run directory moved or copied elsewhere
    gives its own file; one missing there is a :class:`CheckpointError` (never the path the run
    recorded, which may be another run's: the original of a copied run directory), as is a
    last.ckpt that records no best."""
    path, score, last_step, task = _recorded_best(run_dir)
    return path, score, int(read_checkpoint(path)["global_step"]), last_step, task


def checkpoint_files(names: Sequence[str | Path]) -> list[Path]:
    """The checkpoint files that ``names`` mean, in order: a file is itself, ``pretrained:<name>``
    a backbone shipped in the package (:mod:`graphormer_urpe.prediction.pretrained`, with its pretraining
    head); a run directory
    (one with ``checkpoints/last.ckpt``) is its best-validation checkpoint
    (:func:`best_checkpoint`); a directory of run directories (an ablation grid, an ensemble's
    members) is the best checkpoint of each, in name order. :class:`CheckpointError` for a
    directory that is neither, a run whose last.ckpt records no best checkpoint or lacks it, and
    one file named twice (also through a link or a run directory)."""
    from graphormer_urpe.prediction import pretrained

    files = []
    for name in names:
        try:
            name = pretrained.resolve(name, "--ckpt")
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        if not name.is_dir():
            files.append(name)  # a missing or unreadable file is named when it is read
            continue
        runs = [name] if (name / RUN_LAST_CHECKPOINT).exists() else sorted(
            run for run in name.iterdir() if (run / RUN_LAST_CHECKPOINT).exists())
        if not runs:
            raise CheckpointError(f"{name} is a directory that is neither a run directory (no "
                                  f"{RUN_LAST_CHECKPOINT}) nor a folder of run directories")
        files.extend(_recorded_best(run)[0] for run in runs)  # each read once, when loaded
    _refuse_repeated(names, files)
    return files


def _refuse_repeated(names: Sequence[str | Path], files: list[Path]) -> None:
    """:class:`CheckpointError` when two of ``files`` are one file (a path given twice, a link,
    a run directory and its own best checkpoint): the ensemble would hold copies of one model,
    whose std is 0 on every molecule."""
    seen: dict[tuple[int, int] | Path, Path] = {}
    for file in files:
        try:
            status = os.stat(file)
            key: tuple[int, int] | Path = (status.st_dev, status.st_ino)
        except OSError:  # a missing file: named when it is read
            key = file.resolve()
        if key in seen:
            raise CheckpointError(f"--ckpt {seen[key]} and {file} are one checkpoint file (given "
                                  f"{' '.join(map(str, names))}): an ensemble of copies of one model "
                                  "has a std of 0; name each model once")
        seen[key] = file
