r"""What a prediction task is: its loss, metric, head width, prediction transform and columns; a
new task is one :class:`Task` subclass plus its entry in :data:`TASKS`.

Unknown labels are NaN; every loss is the mean over the known labels only (0, and no gradient,
for a batch without any), masked by multiplication so every shape stays fixed. Imports neither
Lightning nor torchmetrics at import time."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

#: ``model.loss`` choices, for regression targets: L1 (the default) or squared error
REGRESSION_LOSSES = ("l1", "mse")


def check_loss_name(loss: str | None) -> None:
    """ValueError unless ``loss`` is None or one of :data:`REGRESSION_LOSSES`."""
    if loss is not None and loss not in REGRESSION_LOSSES:
        raise ValueError(f"model.loss must be one of {list(REGRESSION_LOSSES)}, got {loss!r}")


@dataclass(frozen=True)
class Task:
    """Base class: a task's name, its validation metric (``val/<metric>``) and whether that metric is
    maximised."""

    name: str
    metric_name: str
    maximize: bool

    @property
    def mode(self) -> str:
        return "max" if self.maximize else "min"

    @property
    def monitor(self) -> str:
        return f"val/{self.metric_name}"

    def head_width(self, num_targets: int) -> int:
        return num_targets

    def check_num_targets(self, num_targets: int) -> None:
        if num_targets < 1:
            raise ValueError(f"num_targets must be >= 1, got {num_targets}")

    def losses(self, outputs: Tensor, y: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
        """``(per-label losses, mask)`` with unknown labels already replaced."""
        raise NotImplementedError

    #: the one loss of a task without a choice (what the log line names)
    own_loss = ""

    def with_loss(self, loss: str | None) -> "Task":
        """This task training with ``loss`` (``model.loss``; None: its own). Only regression has a
        choice; the others keep their one loss whatever regression loss is named (so one recipe serves
        every CSV task), said in a log line. A name that is no regression loss is a ValueError."""
        check_loss_name(loss)
        if loss is not None:
            log.info("model.loss %s is for regression targets: this %s model trains with %s",
                     loss, self.name, self.own_loss)
        return self

    def loss(self, outputs: Tensor, y: Tensor) -> Tensor:
        """Mean loss over the known labels of ``y`` (NaN = unknown); 0 if none is known."""
        mean, _ = self.loss_terms(outputs, y)
        return mean

    def loss_terms(self, outputs: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(mean loss over the known labels, their number)``, which weighs the batch in a mean over
        several; device tensors of fixed shapes."""
        losses, known = self.losses(outputs.float(), y, ~torch.isnan(y))
        count = known.sum()
        return (losses * known).sum() / count.clamp_min(1), count

    def metric(self, num_targets: int):
        raise NotImplementedError

    def update_metric(self, metric, outputs: Tensor, y: Tensor) -> None:
        raise NotImplementedError

    def predictions(self, outputs: Tensor) -> Tensor:
        return outputs.float()

    def prediction_columns(self, num_targets: int, target_names: Sequence[str] | None = None) -> list[str]:
        """``prediction_<name>`` per named target, else ``prediction`` (one target) or ``prediction_<k>``."""
        if target_names is not None and len(target_names) == num_targets:
            return [f"prediction_{name}" for name in target_names]
        return ["prediction"] if num_targets == 1 else [f"prediction_{k}" for k in range(num_targets)]


@dataclass(frozen=True)
class RegressionTask(Task):
    """Values: L1 loss and MAE; ``squared`` (``model.loss: mse``) trains on squared error, the metric
    that selects checkpoints stays MAE."""

    squared: bool = False

    def losses(self, outputs: Tensor, y: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
        error = F.mse_loss if self.squared else F.l1_loss
        return error(outputs, torch.where(known, y, outputs.detach()), reduction="none"), known

    def with_loss(self, loss: str | None) -> "RegressionTask":
        check_loss_name(loss)
        return replace(self, squared=loss == "mse")

    def metric(self, num_targets: int):
        from torchmetrics import MeanAbsoluteError

        return MeanAbsoluteError()

    def update_metric(self, metric, outputs: Tensor, y: Tensor) -> None:
        known = ~torch.isnan(y)
        metric.update(outputs.float()[known], y[known])


class ClassificationTask(Task):
    """Binary or multi-label 0/1 targets, one logit each: BCE, ROC-AUC, sigmoid probabilities."""

    own_loss = "binary cross-entropy"

    def losses(self, outputs: Tensor, y: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
        return F.binary_cross_entropy_with_logits(outputs, torch.where(known, y, 0), reduction="none"), known

    def metric(self, num_targets: int):
        from torchmetrics.classification import BinaryAUROC, MultilabelAUROC

        if num_targets == 1:
            return BinaryAUROC(ignore_index=-1)
        return MultilabelAUROC(num_labels=num_targets, ignore_index=-1)

    def update_metric(self, metric, outputs: Tensor, y: Tensor) -> None:
        labels = torch.where(torch.isnan(y), -1, y).long()
        probabilities = self.predictions(outputs)
        if probabilities.shape[1] == 1:
            probabilities, labels = probabilities[:, 0], labels[:, 0]
        metric.update(probabilities, labels)

    def predictions(self, outputs: Tensor) -> Tensor:
        return torch.sigmoid(outputs.float())


class MulticlassTask(Task):
    """One class id per graph, ``num_targets`` = classes: cross-entropy, accuracy, softmax probabilities."""

    own_loss = "cross-entropy"

    def check_num_targets(self, num_targets: int) -> None:
        if num_targets < 2:
            raise ValueError(f"multiclass needs num_targets = number of classes >= 2, got {num_targets}")

    def losses(self, outputs: Tensor, y: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
        known = known[:, 0]
        labels = torch.where(known, y[:, 0], 0).long()
        return F.cross_entropy(outputs, labels, reduction="none"), known

    def metric(self, num_targets: int):
        from torchmetrics.classification import MulticlassAccuracy

        return MulticlassAccuracy(num_classes=num_targets, average="micro", ignore_index=-1)

    def update_metric(self, metric, outputs: Tensor, y: Tensor) -> None:
        metric.update(outputs.float(), torch.where(torch.isnan(y[:, 0]), -1, y[:, 0]).long())

    def predictions(self, outputs: Tensor) -> Tensor:
        return torch.softmax(outputs.float(), dim=-1)

    def prediction_columns(self, num_targets: int, target_names: Sequence[str] | None = None) -> list[str]:
        """``prediction_<label column>_<class>`` (``prediction_<class>`` unnamed)."""
        prefix = f"prediction_{target_names[0]}_" if target_names is not None and len(target_names) == 1 \
            else "prediction_"
        return [f"{prefix}{k}" for k in range(num_targets)]


#: Every task by name.
TASKS: dict[str, Task] = {task.name: task for task in (
    RegressionTask("regression", "mae", maximize=False),
    ClassificationTask("classification", "auroc", maximize=True),
    MulticlassTask("multiclass", "accuracy", maximize=True),
)}


def get_task(name: str) -> Task:
    """The :class:`Task` called ``name``; ValueError naming the choices otherwise."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {name!r}")
    return TASKS[name]
