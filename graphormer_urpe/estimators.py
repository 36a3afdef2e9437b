"""scikit-learn estimators over SMILES: :class:`GraphormerRegressor` and
:class:`GraphormerClassifier` (``docs/python.md``), and :class:`GraphormerEmbedder`, the fast
mode's transformer.

``fit(X, y)`` trains with :func:`graphormer_urpe.api.train` (a recipe and its overrides, as
``graphormer-urpe fit`` takes them) on every molecule of ``X`` but a ``validation_fraction``,
which picks the best checkpoint; ``predict`` is :meth:`graphormer_urpe.api.Model.predict`. So
``clone``, ``cross_val_score``, ``GridSearchCV`` and a ``Pipeline`` take them as any estimator.
X is a list, array or Series of SMILES (or a one-column array or DataFrame, as a Pipeline's
earlier step may give it).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, TransformerMixin

from graphormer_urpe.api import Model, smiles_of, train


_PARAMETERS = """

    Parameters, stored as given:

    - ``recipe``: a packaged recipe's name or a config file (default ``csv``: fine-tune the
      shipped backbone);
    - ``overrides``: other ``fit`` options by key (``{"trainer.max_steps": 200}``);
    - ``validation_fraction``: the share of the molecules held out to choose the best
      checkpoint (at least one molecule);
    - ``random_state``: the seed of that choice and of the fit (``seed_everything``);
    - ``runs_dir``: a folder that keeps each fit's run (a new folder in it per fit, its data
      cache included); ``None``: a temporary folder, removed once the model is loaded.

    Fitted: ``model_`` (the :class:`~graphormer_urpe.api.Model`), ``metrics_`` (the best
    checkpoint's validation metrics), ``run_dir_`` (the run's folder, ``None`` once removed)."""


class _GraphormerEstimator(BaseEstimator):
    """The parameters, the fit and the predictions both estimators share."""

    def __init__(self, recipe: str = "csv", overrides: dict[str, Any] | None = None,
                 validation_fraction: float = 0.1, random_state: int = 0, runs_dir: str | None = None) -> None:
        self.recipe = recipe
        self.overrides = overrides
        self.validation_fraction = validation_fraction
        self.random_state = random_state
        self.runs_dir = runs_dir

    def _fit(self, X, targets: np.ndarray, task: str) -> None:
        """Train on the SMILES of ``X`` and ``targets [n, T]`` (columns ``y0 ...``) for ``task``."""
        import pandas as pd

        smiles = smiles_of(X, "smiles")[1]
        if len(smiles) != len(targets):
            raise ValueError(f"X has {len(smiles)} molecules and y {len(targets)} values")
        if not 0 < self.validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction!r}")
        names = [f"y{k}" for k in range(targets.shape[1])]
        order = np.random.default_rng(self.random_state).permutation(len(smiles))
        held = max(1, round(self.validation_fraction * len(smiles)))
        if held >= len(smiles):
            raise ValueError(f"{len(smiles)} molecules: too few to hold out {held} for validation and train on the rest")
        # The data module wants a test split as well, which a fit never reads: one copy of a
        # validation molecule, in a row of its own after the table's.
        rows = [*range(len(smiles)), int(order[0])]
        table = pd.DataFrame({"smiles": [smiles[r] for r in rows], **{n: targets[rows, k] for k, n in enumerate(names)}})
        split = {"train": sorted(order[held:].tolist()), "val": sorted(order[:held].tolist()), "test": [len(smiles)]}
        if self.runs_dir is not None:
            Path(self.runs_dir).mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="fit-", dir=self.runs_dir))
        try:
            (folder / "split.json").write_text(json.dumps(split))
            run = train(table, smiles="smiles", target=names, recipe=self.recipe, out=folder / "run", overrides={
                "seed_everything": self.random_state, "data.init_args.task": task,
                "data.init_args.split_file": str(folder / "split.json"),
                "data.init_args.cache_root": str(folder / "cache"), **(self.overrides or {})})
        finally:
            if self.runs_dir is None:
                shutil.rmtree(folder, ignore_errors=True)
        self.model_, self.metrics_ = run.model, run.metrics
        self.run_dir_ = run.dir if self.runs_dir is not None else None

    def _predicted(self, X) -> np.ndarray:
        """``[n, columns]`` of :attr:`model_`'s prediction columns; ``ValueError`` naming the
        molecules it cannot predict (:meth:`~graphormer_urpe.api.Model.predict` says why)."""
        model: Model = self.model_
        table = model.predict(X)
        failed = table[table["error"] != ""]
        if len(failed):
            shown = "; ".join(f"{smiles!r}: {error}" for smiles, error in zip(failed["smiles"][:3], failed["error"][:3]))
            raise ValueError(f"{len(failed)} of {len(table)} molecules cannot be predicted ({shown})")
        return table[model.columns].to_numpy(np.float64)


class GraphormerRegressor(RegressorMixin, _GraphormerEstimator):
    __doc__ = "Graphormer + URPE regression of one or more targets from SMILES (``score``: R²)." + _PARAMETERS

    def fit(self, X, y) -> GraphormerRegressor:
        y = np.asarray(y, dtype=np.float64)
        if y.ndim not in (1, 2):
            raise ValueError(f"y: one value per molecule, or one row of values, got shape {y.shape}")
        self._fit(X, y.reshape(len(y), -1), "regression")
        self.y_ndim_ = y.ndim
        return self

    def predict(self, X) -> np.ndarray:
        """``[n]`` (``[n, targets]`` for a two-dimensional ``y``)."""
        values = self._predicted(X)
        return values[:, 0] if self.y_ndim_ == 1 else values


class GraphormerClassifier(ClassifierMixin, _GraphormerEstimator):
    __doc__ = ("Graphormer + URPE classification of SMILES into the classes of ``y`` (any labels; two: one "
               "sigmoid output, more: softmax; ``score``: accuracy). Fitted: also ``classes_``." + _PARAMETERS)

    def fit(self, X, y) -> GraphormerClassifier:
        y = np.asarray(y)
        if y.ndim != 1:
            raise ValueError(f"y: one label per molecule, got shape {y.shape}")
        self.classes_ = np.unique(y)
        if len(self.classes_) < 2:
            raise ValueError(f"y has one class ({self.classes_[0]!r}); a classifier needs at least two")
        ids = np.searchsorted(self.classes_, y).astype(np.float64)
        self._fit(X, ids[:, None], "classification" if len(self.classes_) == 2 else "multiclass")
        return self

    def predict_proba(self, X) -> np.ndarray:
        """``[n, classes]``: each class's probability, in the order of ``classes_``."""
        values = self._predicted(X)
        return np.hstack([1 - values, values]) if len(self.classes_) == 2 else values

    def predict(self, X) -> np.ndarray:
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]


class GraphormerEmbedder(TransformerMixin, BaseEstimator):
    """SMILES to fixed vectors, for any scikit-learn head: the fast mode, no training of the
    backbone (``docs/python.md``). ``transform`` gives each molecule the vector a model's output
    head reads (:meth:`~graphormer_urpe.api.Model.embed`), with ``descriptors`` its RDKit 2D
    descriptors after it, each clipped to the 0.1-99.9 % quantiles of the molecules ``fit`` saw and
    standardized by them (an undefined one is 0, their mean).

    Parameters, stored as given: ``checkpoint`` (what :func:`~graphormer_urpe.api.load` takes;
    one model), ``descriptors`` (bool), ``device``. Fitted: ``model_``, ``descriptor_statistics_``
    (``None`` without descriptors)."""

    def __init__(self, checkpoint: str = "pretrained:zinc-descriptors", descriptors: bool = True,
                 device: str | None = None) -> None:
        self.checkpoint = checkpoint
        self.descriptors = descriptors
        self.device = device

    def fit(self, X, y=None) -> GraphormerEmbedder:
        self._fit(smiles_of(X, "smiles")[1])
        return self

    def fit_transform(self, X, y=None, **fit_params) -> np.ndarray:
        """:meth:`fit` then :meth:`transform`, the descriptors of ``X`` computed once for both."""
        smiles = smiles_of(X, "smiles")[1]
        return self._vectors(smiles, self._fit(smiles))

    def transform(self, X) -> np.ndarray:
        """``[n, D]`` float32 (D: the model's width, plus the descriptors' with ``descriptors``); ``ValueError`` naming the molecules without a
        vector (:meth:`~graphormer_urpe.api.Model.predict` says why)."""
        smiles = smiles_of(X, "smiles")[1]
        return self._vectors(smiles, None)

    def _fit(self, smiles: list[str]) -> np.ndarray | None:
        """Loads the model and fits the descriptors' statistics; returns the raw descriptors."""
        from graphormer_urpe.api import load
        from graphormer_urpe.data.descriptors import clip_statistics

        self.model_ = load(self.checkpoint, device=self.device)
        raw = self._descriptors(smiles) if self.descriptors else None
        self.descriptor_statistics_ = clip_statistics(raw) if self.descriptors else None
        return raw

    def _vectors(self, smiles: list[str], raw: np.ndarray | None) -> np.ndarray:
        """The vectors of ``smiles``, given their raw descriptors where already computed."""
        from graphormer_urpe.data.descriptors import standardize

        vectors = self.model_.embed(smiles)
        failed = [s for s, v in zip(smiles, vectors) if np.isnan(v).any()]
        if failed:
            shown = "; ".join(repr(s) for s in failed[:3])
            raise ValueError(f"{len(failed)} of {len(smiles)} molecules have no vector ({shown}): "
                             "model.predict says why")
        if not self.descriptors:
            return vectors
        standardized = standardize(self._descriptors(smiles) if raw is None else raw, self.descriptor_statistics_)
        return np.hstack([vectors, np.nan_to_num(standardized, nan=0.0)])

    @staticmethod
    def _descriptors(smiles: list[str]) -> np.ndarray:
        """Raw RDKit descriptors ``[n, D]``, in one chunk: in this process, as the embeddings are."""
        from graphormer_urpe.data.descriptors import raw_descriptors

        return np.concatenate(list(raw_descriptors(smiles, chunk_size=max(1, len(smiles)))))
