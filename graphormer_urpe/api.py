"""The package from Python: a trained model loaded, SMILES predicted into a DataFrame and
embedded, a model trained or fine-tuned from a DataFrame or a CSV (``docs/python.md``).

    import graphormer_urpe as gu

    model = gu.load("runs/esol")                      # a run folder, a .ckpt, several, pretrained:<name>
    table = model.predict(["CCO", "c1ccccc1O"])       # a DataFrame: predictions, std, error
    vectors = model.embed(["CCO", "c1ccccc1O"])       # numpy [2, D]
    run = gu.train(frame, smiles="smiles", target="logS", recipe="csv", out="runs/mine")

Predictions are ``graphormer-urpe-predict``'s: the same checkpoints (a run folder is its best),
the same model (an ensemble's mean and std, MC dropout, calibration) and the same rows streamed
through :func:`graphormer_urpe.prediction.run.stream`, kept in memory instead of written. A fit
is ``graphormer-urpe fit`` run in this process (:func:`graphormer_urpe.cli.fit.main`, with the
arguments the call names), so it makes every check the command makes; its one-line refusals
are raised as ``ValueError`` with the command's message.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import json
import os
import sys
import unittest.mock
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Where a fit goes when ``out`` is not given: ``runs/<recipe>/<date and time>`` (chemprop's way:
#: a new folder for every call, so running a notebook cell again never meets the last run).
RUNS_DIR = Path("runs")
#: Characters of a fit's output kept to find its error line.
_TAIL_CHARS = 16_384


def load(checkpoints: str | os.PathLike | Sequence[str | os.PathLike], device: str | None = None) -> Model:
    """The model that ``checkpoints`` name, as ``graphormer-urpe-predict --ckpt`` reads them: a
    checkpoint file, a run folder (its best-validation checkpoint), a folder of run folders (the
    best of each), ``pretrained:<name>`` (a backbone shipped in the package), or several of them
    (an ensemble: their mean, and a std). Every file is read as data and verified
    (:func:`~graphormer_urpe.prediction.load.load_module`). ``device``: a torch device, by default
    ``cuda`` where there is one, else ``cpu``. ``ValueError`` (a ``CheckpointError``) for a
    checkpoint that is missing, damaged or not a model of this version."""
    from graphormer_urpe.prediction.load import checkpoint_files, load_models
    from graphormer_urpe.prediction.run import check_device, default_device

    names = [checkpoints] if isinstance(checkpoints, (str, os.PathLike)) else list(checkpoints)
    files = checkpoint_files(names)
    return Model(load_models(files), files, check_device(device or default_device()))


class Model:
    """A trained model (one checkpoint's, or an ensemble's) that predicts SMILES: :meth:`predict`
    (a DataFrame), :meth:`embed` and :meth:`embed_atoms` (numpy arrays). Made by :func:`load`.

    Options every method takes: ``max_nodes`` (a larger molecule is an error row), ``max_pairs``
    and ``batch_size`` (a batch's padded node pairs and molecules: peak memory), ``workers``
    (processes that featurize and, on the CPU, predict; 0, the default: all in this process) and
    ``progress`` (a progress bar on stderr), as ``graphormer-urpe-predict`` takes them."""

    def __init__(self, module, checkpoints: list[Path], device) -> None:
        #: the loaded model: a :class:`~graphormer_urpe.prediction.model.PredictionModel`, or a
        #: :class:`~graphormer_urpe.prediction.model.ModelEnsemble` of several
        self.module = module.to(device)
        #: the checkpoint files it was loaded from
        self.checkpoints = checkpoints
        self.device = device

    @property
    def task(self) -> str:
        """``regression``, ``classification`` or ``multiclass``."""
        return self.module.facts.task

    @property
    def columns(self) -> list[str]:
        """The prediction columns of :meth:`predict` (``prediction_<target>``), without std."""
        from graphormer_urpe.prediction.table import prediction_columns

        return prediction_columns(self.module)

    def __repr__(self) -> str:
        models = f"{len(self.checkpoints)} checkpoints" if len(self.checkpoints) > 1 else str(self.checkpoints[0])
        return f"Model({models}, task={self.task!r}, columns={self.columns}, device={str(self.device)!r})"

    def predict(self, molecules, smiles: str = "smiles", *, mc_dropout: int | None = None, seed: int = 0,
                calibrate: str | os.PathLike | Any | None = None, **options):
        """Predictions for ``molecules``: a list (or array, Series) of SMILES, or a DataFrame whose
        ``smiles`` column holds them. A DataFrame with the input's index: for a DataFrame its
        columns (``input_`` before a name the output uses), else ``smiles``; one
        ``prediction_<target>`` column per target (probabilities for a classifier); for an
        ensemble, and with ``mc_dropout`` N (N predictions with dropout on, masks from ``seed``),
        a ``std_<target>`` column each; ``error``: why a row has no prediction (RDKit rejects
        its SMILES, an atom outside the featurizer's vocabulary, more than ``max_nodes`` atoms),
        empty where it has one. ``calibrate``: molecules with measured values in the columns of
        the model's targets (a CSV, or a DataFrame), to which each std is scaled
        (``graphormer-urpe-predict --calibrate``). The same numbers as
        ``graphormer-urpe-predict`` on the same checkpoints and SMILES."""
        import pandas as pd

        from graphormer_urpe.prediction.run import predicting
        from graphormer_urpe.prediction.table import input_names, prediction_columns

        streaming = _streaming(options)
        index, texts, frame = smiles_of(molecules, smiles)
        module = predicting(self.module, self.device, mc_dropout=mc_dropout, seed=seed, max_pairs=streaming.max_pairs)
        if calibrate is not None:
            module = self._calibrated(module, calibrate, smiles, streaming)
        columns = prediction_columns(module)
        errors, outputs = _predicted(module, texts, streaming)
        values = np.concatenate([o.predictions for o in outputs]) if outputs else np.zeros((0, len(columns)), np.float32)
        if frame is not None:
            result = frame.copy()
            result.columns = input_names([str(c) for c in frame.columns], columns)
        else:
            result = pd.DataFrame({"smiles": texts}, index=index)
        for k, column in enumerate(columns):
            result[column] = values[:, k]
        result["error"] = errors
        return result

    def embed(self, molecules, smiles: str = "smiles", **options) -> np.ndarray:
        """The vector the output head reads for each molecule (the graph token's, the atoms' sum
        or both, as the model's readout): float32 ``[molecules, D]`` in input order, NaN for a
        molecule without prediction (:meth:`predict` says why). One model only."""
        width, outputs = self._embeddings(molecules, smiles, False, options)
        return np.concatenate([o.embeddings for o in outputs]) if outputs else np.zeros((0, width), np.float32)

    def embed_atoms(self, molecules, smiles: str = "smiles", **options) -> list[np.ndarray | None]:
        """Each atom's final vector, per molecule: float32 ``[atoms, D]`` (RDKit's atom order of its
        SMILES, hydrogens implicit), ``None`` for a molecule without prediction. One model only."""
        return [atoms for output in self._embeddings(molecules, smiles, True, options)[1] for atoms in output.atoms]

    def _embeddings(self, molecules, smiles: str, atoms: bool, options: dict):
        """The embedding width and the chunks' outputs of one model's embeddings."""
        from graphormer_urpe.prediction.run import predicting

        module = predicting(self.module, self.device, embeddings=True, atoms=atoms)
        return module.width, _predicted(module, smiles_of(molecules, smiles)[1], _streaming(options))[1]

    def _calibrated(self, module, calibrate, smiles: str, streaming):
        """``module`` with its std scaled to fit the errors on ``calibrate`` (a CSV, or a DataFrame
        written to a temporary one with its SMILES column named ``smiles``)."""
        import tempfile

        from graphormer_urpe.prediction.uncertainty import calibrated, check_calibrate

        with tempfile.TemporaryDirectory() as folder:
            path = Path(calibrate) if isinstance(calibrate, (str, os.PathLike)) else Path(folder) / "calibrate.csv"
            if not isinstance(calibrate, (str, os.PathLike)):
                _frame_with(calibrate, smiles).rename(columns={smiles: "smiles"}).to_csv(path, index=False)
            return calibrated(module, path, check_calibrate(module, path), streaming)


def _streaming(options: Mapping[str, Any]):
    """The :class:`~graphormer_urpe.prediction.run.Streaming` of a call's ``options``; the
    progress bar only with ``progress=True``, all in this process unless ``workers`` says."""
    from dataclasses import fields

    from graphormer_urpe.prediction.run import Streaming

    names = {field.name for field in fields(Streaming)} - {"quiet"}
    unknown = sorted(set(options) - names - {"progress"})
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; the options are {sorted(names | {'progress'})}")
    return Streaming(**{k: v for k, v in options.items() if k in names}, quiet=not options.get("progress", False))


def _predicted(module, smiles: list[str], streaming):
    """Every SMILES predicted by ``module``: each row's error (empty where predicted) and each
    chunk's :class:`~graphormer_urpe.prediction.model.ChunkOutput` (NaN where not), in order."""
    from graphormer_urpe.prediction.run import stream
    from graphormer_urpe.prediction.table import smiles_list

    errors, outputs = [], []

    def keep(rows, output) -> None:
        errors.extend(row.error for row in rows)
        outputs.append(output)

    stream(module, smiles_list(smiles), streaming, "predict", keep)
    return errors, outputs


def _frame_with(frame, *columns: str):
    """``frame`` (a DataFrame) where it has ``columns``; a one-line ``ValueError`` naming those it
    lacks otherwise."""
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise ValueError(f"the DataFrame has no column(s) {missing} (columns: {list(frame.columns)})")
    return frame


def smiles_of(molecules, smiles: str):
    """``(index, SMILES, DataFrame or None)`` of what a call was given: a DataFrame (its
    ``smiles`` column), a Series, an array or any sequence of SMILES. A missing value (None,
    NaN) is an empty SMILES, which gets an error row."""
    import pandas as pd

    if isinstance(molecules, (str, bytes)):
        raise TypeError("molecules: give a list of SMILES (a str is one SMILES: [smiles]), a pandas "
                        "Series or a DataFrame with a SMILES column")
    frame = None
    if isinstance(molecules, pd.DataFrame):
        frame = _frame_with(molecules, smiles)
        values, index = frame[smiles], frame.index
    elif isinstance(molecules, pd.Series):
        values, index = molecules, molecules.index
    else:
        array = np.asarray(molecules, dtype=object)
        if array.ndim == 2 and array.shape[1] == 1:  # one feature column, as scikit-learn passes X
            array = array[:, 0]
        if array.ndim != 1:
            raise ValueError(f"molecules: one SMILES per row, got an array of shape {array.shape}")
        values, index = array, pd.RangeIndex(len(array))
    texts = [value if isinstance(value, str) else "" if value is None or pd.isna(value) else str(value)
             for value in values]
    return index, texts, frame


# ------------------------------------------------------------------------------------ training
@dataclass
class Run:
    """A finished fit: its folder (``dir``: the command's ``--trainer.default_root_dir``), its
    best-validation checkpoint, the validation metrics logged when that checkpoint was saved
    (``{"val/loss": ..., "val/mae": ...}``) and the model loaded from it."""

    dir: Path
    best_checkpoint: Path
    metrics: dict[str, float]
    model: Model

    @classmethod
    def read(cls, folder: str | os.PathLike, device: str | None = None) -> Run:
        """The run in ``folder`` (a fit's folder; ``ValueError`` where it records no best checkpoint)."""
        from graphormer_urpe.prediction.load import best_checkpoint

        folder = Path(folder)
        best, score, _, _, task = best_checkpoint(folder)
        return cls(folder, best, _logged_metrics(folder, task.monitor, score), load(best, device))


def _logged_metrics(folder: Path, monitor: str, score: float) -> dict[str, float]:
    """The validation metrics of the row of the run's CSV log (``metrics.csv``, newest first)
    whose ``monitor`` is the best checkpoint's ``score``; ``{monitor: score}`` where the run kept
    no CSV log (``--trainer.logger false``)."""
    import pandas as pd

    logs = sorted(folder.glob("**/metrics.csv"), key=lambda path: path.stat().st_mtime, reverse=True)
    for log in logs:
        table = pd.read_csv(log)
        if monitor not in table:
            continue
        rows = table[table[monitor].to_numpy(np.float32) == np.float32(score)]
        if len(rows):
            row = rows.iloc[-1]
            return {name: float(row[name]) for name in table.columns if name.startswith("val/") and pd.notna(row[name])}
    return {monitor: score}


def train(data, smiles: str = "smiles", target: str | Sequence[str] | None = None, *, recipe: str = "csv",
          overrides: Mapping[str, Any] | None = None, out: str | os.PathLike | None = None) -> Run:
    """Train (by default fine-tune the shipped backbone: the ``csv`` recipe) on ``data``, a
    DataFrame or a CSV file, as ``graphormer-urpe fit --config RECIPE`` does, and return the
    :class:`Run`. ``smiles``: the SMILES column; ``target``: the target column (or columns;
    None: every other column); ``recipe``: a packaged recipe's name or a config file;
    ``overrides``: any other ``fit`` option by its key (``{"trainer.max_steps": 200,
    "data.init_args.task": "classification", "model.backbone": {"num_layers": 4}}``: lists and
    mappings are given as JSON). ``out``: the run's folder (default ``runs/<recipe>/<date and
    time>``, a new one each call). A DataFrame is written there as ``data-<hash>.csv`` (the
    run's config names it, so the command can resume or test the run). ``ValueError`` with the
    command's one-line message for anything it refuses (an unknown recipe or option, a missing
    column, a run folder that holds another run), before any long work; ``RuntimeError`` for a
    fit that fails (a diverged run); ``KeyboardInterrupt`` for a fit stopped by Ctrl-C (its
    checkpoints written so far are whole: resume with ``overrides={"ckpt_path": "last"}``)."""
    from graphormer_urpe.training.recipes import resolve_config

    resolve_config(recipe)  # an unknown recipe: one line, before anything is written
    overrides = dict(overrides or {})
    if any(key.lstrip("-") == "trainer.default_root_dir" for key in overrides):
        raise ValueError("train: the run's folder is out=, not overrides['trainer.default_root_dir']")
    targets = [target] if isinstance(target, str) else None if target is None else list(target)
    out = Path(out) if out is not None else _new_run_dir(recipe)
    path = data if isinstance(data, (str, os.PathLike)) else _written_frame(data, smiles, targets or [], out)
    args = ["fit", "--config", recipe, "--trainer.default_root_dir", str(out),
            "--data.init_args.path", str(path), "--data.init_args.smiles_column", smiles,
            *(["--data.init_args.target_columns", json.dumps(targets)] if targets else []),
            *_option_args(overrides)]
    _fit(args)
    return Run.read(out)


def _new_run_dir(recipe: str) -> Path:
    """``runs/<recipe>/<date and time>``, a folder no run has used."""
    stem = Path(recipe).stem
    base = RUNS_DIR / stem / datetime.datetime.now().strftime("%Y-%m-%dT%H-%M-%S")
    folder, k = base, 1
    while folder.exists():
        folder, k = base.with_name(f"{base.name}-{k}"), k + 1
    return folder


def _written_frame(frame, smiles: str, targets: list[str], out: Path) -> Path:
    """``frame`` as the CSV ``out/data-<hash of its content>.csv`` (a file of that content is
    kept as it is: another table never replaces the one a run was trained on); ``ValueError``
    for a DataFrame without the named columns."""
    import pandas as pd

    from graphormer_urpe.utils.files import atomic_write

    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"data: a pandas DataFrame or a CSV file's path, got {type(frame).__name__}")
    text = _frame_with(frame, smiles, *targets).to_csv(index=False, lineterminator="\n")
    path = out / f"data-{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}.csv"
    if not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as handle:
            handle.write(text)
    return path


def _option_args(options: Mapping[str, Any]) -> list[str]:
    """``--key value`` for each option: a string as it is, anything else as JSON."""
    args = []
    for key, value in options.items():
        args += [f"--{key.lstrip('-')}", value if isinstance(value, str) else json.dumps(
            str(value) if isinstance(value, os.PathLike) else value)]
    return args


class _Tail:
    """A text stream that writes through to ``stream`` and keeps the last characters written."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self._kept: collections.deque[str] = collections.deque()
        self._size = 0

    def write(self, text: str) -> int:
        self._kept.append(text)
        self._size += len(text)
        while self._size - len(self._kept[0]) > _TAIL_CHARS:
            self._size -= len(self._kept.popleft())
        return self.stream.write(text)

    def text(self) -> str:
        return "".join(self._kept)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _fit(args: list[str]) -> None:
    """``graphormer-urpe`` with ``args`` in this process; its one-line refusal (exit status 2)
    raised as a ``ValueError``, a stop by Ctrl-C as ``KeyboardInterrupt``, any other failure as
    a ``RuntimeError``, each with the command's message."""
    from graphormer_urpe.cli.fit import main
    from graphormer_urpe.utils.process import INTERRUPTED

    tail = _Tail(sys.stderr)
    # the command reads args, not this process's command line (a notebook kernel's own options)
    with contextlib.redirect_stderr(tail), unittest.mock.patch.object(sys, "argv", sys.argv[:1]):
        try:
            status = main(args)
        except SystemExit as exit:  # the argument parser's refusal, after its usage and error line
            status = exit.code if isinstance(exit.code, int) else 2
    if status == 0:
        return
    message = _error_line(tail.text()) or f"graphormer-urpe {' '.join(args)}: exit status {status}"
    raise (ValueError if status == 2 else KeyboardInterrupt if status == INTERRUPTED else RuntimeError)(message)


def _error_line(output: str) -> str:
    """The error a command ended with: its last ``graphormer-urpe: error: ...`` or ``error: ...``
    line and what follows it, or its last line."""
    lines = [line for line in output.splitlines() if line.strip()]
    for k in range(len(lines) - 1, -1, -1):
        for prefix in ("graphormer-urpe: error: ", "error: "):
            if lines[k].startswith(prefix):
                return "\n".join([lines[k][len(prefix):], *lines[k + 1:]]).strip()
    return lines[-1].strip() if lines else ""
