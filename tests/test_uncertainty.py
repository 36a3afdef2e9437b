"""The uncertainty scores on errors drawn from the std they claim (calibrated by construction),
on a std that is 3x too small, and at the edges (a std of 0, nothing measured)."""
import numpy as np
import pytest

from graphormer_urpe.prediction.uncertainty import regression_scores


def test_a_calibrated_std_scores_as_a_gaussian_and_an_overconfident_one_does_not():
    rng = np.random.default_rng(0)
    std = rng.uniform(0.1, 2.0, 20_000)
    measured = rng.normal(0.0, 1.0, std.shape)
    predicted = measured + rng.normal(0.0, std)
    calibrated = regression_scores(measured, predicted, std)
    assert calibrated["within_1_std"] == pytest.approx(0.683, abs=0.01)
    assert calibrated["within_2_std"] == pytest.approx(0.954, abs=0.01)
    assert calibrated["miscalibration_area"] < 0.01
    assert calibrated["spearman"] > 0.3  # a larger std does flag a larger error
    overconfident = regression_scores(measured, predicted, std / 3)
    assert overconfident["miscalibration_area"] > 0.2 and overconfident["nll"] > calibrated["nll"] + 1


def test_edges():
    scores = regression_scores(np.array([1.0, 2.0, np.nan]), np.array([1.0, 2.5, 3.0]), np.array([0.0, 0.5, 1.0]))
    assert scores["molecules"] == 2 and np.isfinite(scores["nll"]) and scores["within_1_std"] == 1.0
    assert regression_scores(np.array([np.nan]), np.array([1.0])) == {"molecules": 0}
