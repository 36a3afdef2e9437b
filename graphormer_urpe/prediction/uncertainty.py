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
"""
from __future__ import annotations

import math

import numpy as np

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
