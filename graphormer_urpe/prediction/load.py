"""A model from a checkpoint, verified before use (:func:`load_module`), and the checkpoint files
that a user's names mean (:func:`checkpoint_files`: files, run directories, folders of runs).
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
    """The arguments of ``GraphormerModule`` that a checkpoint's hyperparameters give (the facts
    as one dict), as both :func:`load_module` and LightningCLI's ``--ckpt_path`` read them."""
    from graphormer_urpe.data.facts import DataFacts

    return {name: value for name, value in DataFacts.nest(hyper_parameters).items()
            if name not in ("_instantiator", "_class_path", *RETIRED_HPARAMS)}


def load_module(ckpt: str | Path, map_location: str = "cpu", *, model_class: type | None = None):
    """The model of a Lightning checkpoint in eval mode: a
    :class:`~graphormer_urpe.prediction.model.PredictionModel` (no Lightning import), or
    ``model_class`` built alike. :class:`CheckpointError` naming the file for a missing or
    damaged file, content that is not plain data, non-finite weights, and hyperparameters or
    weights that do not build this version's model or predict a probe molecule."""
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
    """The model (:func:`load_module`) of one checkpoint, or the
    :class:`~graphormer_urpe.prediction.model.ModelEnsemble` of several."""
    models = [load_module(ckpt) for ckpt in ckpts]
    return models[0] if len(models) == 1 else ModelEnsemble(models, list(map(str, ckpts)))


def model_checkpoint_state(checkpoint: dict, monitor: str | None = None) -> dict | None:
    """The state a ``ModelCheckpoint`` that monitors ``monitor`` (any, if None) stored in
    ``checkpoint`` (``best_model_path``, ``best_model_score``, ...), else None; Lightning keys it
    ``ModelCheckpoint{<its arguments>}``."""
    return next((state for key, state in checkpoint.get("callbacks", {}).items()
                 if key.startswith("ModelCheckpoint") and (monitor is None or state.get("monitor") == monitor)),
                None)


def recorded_best(checkpoint_dir: Path, monitor: str, last: dict) -> tuple[Path | None, float | None]:
    """The best ``monitor`` checkpoint that ``last`` (``checkpoint_dir``'s ``last.ckpt``) records,
    and its score, else ``(None, None)``; looked up by name in ``checkpoint_dir`` only, so a copied
    run folder never uses the original's file."""
    state = model_checkpoint_state(last, monitor)
    if not state or not state.get("best_model_path"):
        return None, None
    return Path(checkpoint_dir) / Path(state["best_model_path"]).name, float(state["best_model_score"])


def _recorded_best(run_dir: Path):
    """``(best path, its score, last step, the task)`` of a run directory, from its
    ``last.ckpt``; :class:`CheckpointError` where it records no best or the file is missing."""
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
    """``(best path, its validation score, its step, last step, the task)`` of a run directory
    (:func:`_recorded_best`)."""
    path, score, last_step, task = _recorded_best(run_dir)
    return path, score, int(read_checkpoint(path)["global_step"]), last_step, task


def checkpoint_files(names: Sequence[str | Path]) -> list[Path]:
    """The checkpoint files that ``names`` mean, in order: a file is itself, ``pretrained:<name>``
    a shipped backbone, a run directory its best-validation checkpoint, a directory of run
    directories the best of each in name order. :class:`CheckpointError` for a directory that is
    neither, a run without its best, and one file named twice (an ensemble of copies of one
    model would have a std of 0)."""
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
    return files
