r"""How good are regression predictions, and their standard deviations, against measured values.

:func:`regression_scores` gives the errors (RMSE, MAE) and, where a std comes with each
prediction (an ensemble of checkpoints, MC dropout), the scores chemprop and the uncertainty
literature use to judge it (Tran et al., 2020; Hirschfeld et al., 2020):

- ``spearman``: rank correlation of the std with the absolute error (does a larger std flag a
  larger error?);
- ``nll``: mean Gaussian negative log-likelihood of the measured value,
  :math:`\tfrac12 \log(2\pi\sigma^2) + (y - \hat y)^2 / (2\sigma^2)`;
- ``miscalibration_area``: the mean, over expected proportions :math:`p` on a grid of 99
  points in (0, 1), of :math:`|o(p) - p|`, where :math:`o(p)` is the share of molecules whose error
  lies inside the central :math:`p` interval of :math:`N(0, \sigma^2)`; 0 for a calibrated std, up to 0.5;
- ``within_1_std``, ``within_2_std``: the share of errors inside 1 and 2 std (a Gaussian has
  68.3 % and 95.4 %).

:func:`std_scale` fits the factor that makes a std read as a Gaussian's error bar.

``graphormer-urpe-predict``'s ``--calibrate`` (:func:`calibrated`) and ``--evaluate``
(:func:`evaluation`) compare with a file of measured values, each after its one-line check.
"""
from __future__ import annotations

import contextlib
import csv
import io
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from graphormer_urpe.prediction.model import ScaledStd
from graphormer_urpe.prediction.run import Streaming, stream
from graphormer_urpe.prediction.table import PredictionTable, prediction_columns, read_smiles

log = logging.getLogger(__name__)

#: Expected proportions of the miscalibration area.
PROPORTIONS = np.linspace(0.01, 0.99, 99)


def regression_scores(measured: np.ndarray, predicted: np.ndarray, std: np.ndarray | None = None) -> dict:
    """Scores of the molecules where the measured and predicted values (and the std) are finite:
    ``molecules``, ``rmse``, ``mae`` and, with ``std``, the uncertainty scores of the module
    docstring (a std below 1e-12 counts as 1e-12, so ``nll`` stays finite)."""
    from scipy.stats import norm, spearmanr

    measured, predicted = np.asarray(measured, np.float64), np.asarray(predicted, np.float64)
    usable = np.isfinite(measured) & np.isfinite(predicted)
    if std is not None:
        std = np.asarray(std, np.float64)
        usable &= np.isfinite(std)
    error = predicted[usable] - measured[usable]
    scores = {"molecules": int(usable.sum())}
    if not len(error):
        return scores
    scores.update(rmse=float(np.sqrt(np.mean(error ** 2))), mae=float(np.mean(np.abs(error))))
    if std is None:
        return scores
    sigma = np.maximum(std[usable], 1e-12)
    inside = np.abs(error)[:, None] <= sigma[:, None] * norm.ppf((1 + PROPORTIONS) / 2)[None, :]
    rho = spearmanr(sigma, np.abs(error)).statistic if len(error) > 1 else math.nan
    scores.update(
        spearman=float(rho),
        nll=float(np.mean(0.5 * np.log(2 * np.pi * sigma ** 2) + error ** 2 / (2 * sigma ** 2))),
        miscalibration_area=float(np.mean(np.abs(inside.mean(axis=0) - PROPORTIONS))),
        within_1_std=float(np.mean(np.abs(error) <= sigma)),
        within_2_std=float(np.mean(np.abs(error) <= 2 * sigma)),
    )
    return scores


def std_scale(measured: np.ndarray, predicted: np.ndarray, std: np.ndarray) -> tuple[float, int]:
    r"""The factor :math:`s` for which :math:`N(\hat y, (s \sigma)^2)` makes the measured values
    most likely (sigma scaling, Levi et al., 2022; chemprop's ``zscaling``):
    :math:`s^2 = \mathrm{mean}((y - \hat y)^2 / \sigma^2)`, over the molecules where all three are
    finite and the std is positive; with their number. ``ValueError`` if there is none."""
    measured, predicted, std = (np.asarray(a, np.float64) for a in (measured, predicted, std))
    usable = np.isfinite(measured) & np.isfinite(predicted) & np.isfinite(std) & (std > 0)
    if not usable.any():
        raise ValueError("no molecule with a measured value, a prediction and a positive std")
    z = (predicted[usable] - measured[usable]) / std[usable]
    return float(np.sqrt(np.mean(z ** 2))), int(usable.sum())


# ------------------------------------------------------------------ against measured values
def _check_regression(option: str, module) -> None:
    if module.facts.task != "regression":
        raise ValueError(f"{option} compares a regression model's predictions with measured values; "
                         f"this model's task is {module.facts.task!r}")


def _check_columns(option: str, path: Path, header: list[str] | None, columns: Sequence[str]) -> None:
    if header is None:
        raise ValueError(f"{option} reads measured values from a CSV with a header; {path} is one SMILES a line")
    missing = [c for c in columns if c not in header]
    if missing:
        raise ValueError(f"{option}: {path} has no column(s) {missing} (columns: {header})")


def check_calibrate(module, calibration: Path) -> list[str]:
    """The measured columns of ``calibration``, in target order, for a regression model that
    predicts a std and names its targets (ValueError otherwise)."""
    if not getattr(module, "predicts_std", False):
        raise ValueError("--calibrate scales the std columns: give several --ckpt or --mc-dropout N")
    _check_regression("--calibrate", module)
    names = module.hparams.get("target_names")
    if not names:
        raise ValueError("--calibrate reads the measured values from the columns of the model's targets, "
                         "and this checkpoint records no target names")
    with read_smiles(calibration) as table:
        _check_columns("--calibrate", calibration, table.columns, list(names))
    return list(names)


def check_evaluate(columns: Sequence[str], header: list[str] | None, module, source: Path, target: Path) -> None:
    """``--evaluate`` needs a regression model, one measured column of ``source`` per target,
    and an output it can read back."""
    if target.exists() and not target.is_file():
        raise ValueError(f"--evaluate reads the predictions back from --output, so {target} must be a "
                         "regular file")
    _check_regression("--evaluate", module)
    _check_columns("--evaluate", source, header, columns)
    if len(columns) != module.facts.num_targets:
        raise ValueError(f"--evaluate needs one column per target: the model has {module.facts.num_targets}, "
                         f"got {len(columns)}")


def calibrated(module, calibration: Path, columns: Sequence[str], streaming: Streaming) -> ScaledStd:
    """``module`` with each target's std scaled by :func:`std_scale` fitted on ``calibration``'s
    measured ``columns`` (predicted into memory: no temporary file to fail)."""
    names, num_targets = prediction_columns(module), module.facts.num_targets
    predicted = io.StringIO(newline="")
    with read_smiles(calibration) as table_input:
        table = PredictionTable(predicted, names, table_input.columns)
        stream(module, table_input, streaming, "calibrate", lambda rows, output: table.write(rows, output.predictions))
    predicted.seek(0)
    scales = []
    for k, (measured, prediction, std) in enumerate(_read_back(columns, calibration, predicted, names, num_targets)):
        scale, count = std_scale(measured, prediction, std)
        log.info("%s scaled by %.4g (fitted on %d molecules of %s)", names[num_targets + k], scale,
                 count, calibration)
        scales.append(scale)
    return ScaledStd(module, scales)


def evaluation(columns: Sequence[str], source: Path, target: Path, module) -> Iterator[tuple[str, str, dict]]:
    """Per target: ``(prediction column, measured column, scores)`` of the table written to
    ``target`` against ``source``'s measured ``columns``."""
    names = prediction_columns(module)
    for k, (measured, predicted, std) in enumerate(
            _read_back(columns, source, target, names, module.facts.num_targets)):
        yield names[k], columns[k], regression_scores(measured, predicted, std)


def _numbers(values) -> np.ndarray:
    out = []
    for value in values:
        try:
            out.append(float(value))
        except (TypeError, ValueError):  # empty or not a number: not measured
            out.append(float("nan"))
    return np.array(out)


def _read_back(columns: Sequence[str], source: Path, target: Path | TextIO, names: list[str], num_targets: int):
    """Per target: ``(measured, predicted, std or None)`` arrays from ``source``'s ``columns``
    and the table ``target`` (a file, or its text)."""
    with open(source, newline="", encoding="utf-8-sig") as handle:
        measured = list(csv.DictReader(handle))
    with (open(target, newline="", encoding="utf-8") if isinstance(target, Path)
          else contextlib.nullcontext(target)) as handle:
        predicted = list(csv.DictReader(handle))
    for k, column in enumerate(columns):
        std = _numbers(r[names[num_targets + k]] for r in predicted) if len(names) > num_targets else None
        yield _numbers(r[column] for r in measured), _numbers(r[names[k]] for r in predicted), std
