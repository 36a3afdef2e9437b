"""The tasks' maths (graphormer_urpe/data/task.py) against torch's own losses and torchmetrics on the
known labels alone: unknown (NaN) labels add nothing to a loss or a metric nor any NaN to a
gradient, a batch without a known label has loss 0, and predictions and columns follow the task."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from graphormer_urpe.data.task import TASKS, get_task

NAN = math.nan


def test_regression_loss_is_the_l1_mean_over_known_labels():
    outputs = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.0]], requires_grad=True)
    y = torch.tensor([[0.0, NAN], [5.0, 1.0], [NAN, NAN]])
    loss = get_task("regression").loss(outputs, y)
    known = ~torch.isnan(y)
    expected = F.l1_loss(outputs[known], y[known])
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert torch.isfinite(outputs.grad).all()
    assert outputs.grad[2].abs().sum() == 0 and outputs.grad[0, 1] == 0  # unknown: no gradient


def test_regression_with_loss_mse_is_the_squared_error_mean_over_known_labels():
    outputs = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.0]], requires_grad=True)
    y = torch.tensor([[0.0, NAN], [5.0, 1.0], [NAN, NAN]])
    task = get_task("regression").with_loss("mse")
    loss = task.loss(outputs, y)
    known = ~torch.isnan(y)
    torch.testing.assert_close(loss, F.mse_loss(outputs[known], y[known]))
    loss.backward()
    assert torch.isfinite(outputs.grad).all() and outputs.grad[2].abs().sum() == 0
    assert task.monitor == "val/mae"  # checkpoints are still chosen by MAE
    assert get_task("regression").with_loss("l1") == get_task("regression").with_loss(None) == get_task("regression")
    with pytest.raises(ValueError, match="model.loss must be one of"):
        get_task("regression").with_loss("huber")
    for name in ("classification", "multiclass"):  # one loss each: a regression loss is passed over
        assert get_task(name).with_loss("mse") == get_task(name).with_loss(None) == get_task(name)
        with pytest.raises(ValueError, match="model.loss must be one of"):
            get_task(name).with_loss("huber")


def test_classification_loss_is_bce_over_known_labels():
    outputs = torch.tensor([[2.0, -1.0, 0.3], [-0.5, 0.7, 1.2]], requires_grad=True)
    y = torch.tensor([[1.0, NAN, 0.0], [0.0, 1.0, NAN]])
    loss = get_task("classification").loss(outputs, y)
    known = ~torch.isnan(y)
    torch.testing.assert_close(loss, F.binary_cross_entropy_with_logits(outputs[known], y[known]))
    loss.backward()
    assert torch.isfinite(outputs.grad).all() and outputs.grad[0, 1] == 0 and outputs.grad[1, 2] == 0


def test_multiclass_loss_is_cross_entropy_over_known_labels():
    outputs = torch.tensor([[2.0, -1.0, 0.3], [-0.5, 0.7, 1.2], [0.1, 0.2, 0.3]], requires_grad=True)
    y = torch.tensor([[0.0], [2.0], [NAN]])
    loss = get_task("multiclass").loss(outputs, y)
    torch.testing.assert_close(loss, F.cross_entropy(outputs[:2], torch.tensor([0, 2])))
    loss.backward()
    assert torch.isfinite(outputs.grad).all() and outputs.grad[2].abs().sum() == 0


@pytest.mark.parametrize("name, width", [("regression", 2), ("classification", 2), ("multiclass", 3)])
def test_a_batch_without_known_labels_has_loss_zero_and_a_finite_gradient(name, width):
    outputs = torch.randn(4, width, requires_grad=True)
    y = torch.full((4, 1 if name == "multiclass" else width), NAN)
    loss = get_task(name).loss(outputs, y)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(outputs.grad, torch.zeros_like(outputs))


def test_metrics_see_only_known_labels():
    from torchmetrics import MeanAbsoluteError
    from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy

    regression = get_task("regression")
    metric = regression.metric(1)
    regression.update_metric(metric, torch.tensor([[1.0], [2.0], [9.0]]), torch.tensor([[0.0], [2.5], [NAN]]))
    expected = MeanAbsoluteError()
    expected.update(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 2.5]))
    torch.testing.assert_close(metric.compute(), expected.compute())

    classification = get_task("classification")
    metric = classification.metric(1)
    logits = torch.tensor([[2.0], [-1.0], [0.5], [3.0]])
    classification.update_metric(metric, logits, torch.tensor([[1.0], [0.0], [0.0], [NAN]]))
    expected = BinaryAUROC()
    expected.update(torch.sigmoid(logits[:3, 0]), torch.tensor([1, 0, 0]))
    torch.testing.assert_close(metric.compute(), expected.compute())

    multiclass = get_task("multiclass")
    metric = multiclass.metric(3)
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 3.0, 0.0]])
    multiclass.update_metric(metric, logits, torch.tensor([[0.0], [1.0], [NAN]]))
    expected = MulticlassAccuracy(num_classes=3, average="micro")
    expected.update(logits[:2], torch.tensor([0, 1]))
    torch.testing.assert_close(metric.compute(), expected.compute())  # 1 of 2 known right


def test_predictions_heads_and_columns():
    outputs = torch.tensor([[0.0, 2.0], [-1.0, 1.0]])
    torch.testing.assert_close(get_task("regression").predictions(outputs), outputs)
    torch.testing.assert_close(get_task("classification").predictions(outputs), torch.sigmoid(outputs))
    probabilities = get_task("multiclass").predictions(outputs)
    torch.testing.assert_close(probabilities.sum(1), torch.ones(2))
    assert get_task("multiclass").head_width(4) == 4 and get_task("regression").head_width(3) == 3
    assert get_task("regression").prediction_columns(1) == ["prediction"]
    assert get_task("regression").prediction_columns(2, ["logS", "mp"]) == ["prediction_logS", "prediction_mp"]
    assert get_task("classification").prediction_columns(2) == ["prediction_0", "prediction_1"]
    assert get_task("multiclass").prediction_columns(3, ["kind"]) == ["prediction_kind_0", "prediction_kind_1",
                                                                       "prediction_kind_2"]


def test_task_choices_and_target_counts_are_checked():
    assert {task.monitor: task.mode for task in TASKS.values()} == {
        "val/mae": "min", "val/auroc": "max", "val/accuracy": "max"}
    with pytest.raises(ValueError, match=r"task must be one of \['regression', 'classification', 'multiclass'\], got 'regresion'"):
        get_task("regresion")
    with pytest.raises(ValueError, match="num_targets must be >= 1"):
        get_task("regression").check_num_targets(0)
    with pytest.raises(ValueError, match="multiclass needs num_targets = number of classes >= 2"):
        get_task("multiclass").check_num_targets(1)
