"""The callback in every trial's ``fit`` of ``graphormer-urpe-hpopt`` (added by
:mod:`.search`), apart from the search so that the search starts without Lightning."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from graphormer_urpe.training.studies.search import DIVERGED_MARKER, PROG, PRUNED_MARKER, TRIAL_ENV, make_pruner
from graphormer_urpe.utils.files import atomic_write


class ReportToTrial(Callback):
    """Reports the validation metric to the trial of :data:`TRIAL_ENV` after each validation
    (step: 0, 1, ...) and stops the run with ``pruned.json`` when the pruner says so, or with
    ``diverged.json`` at a non-finite metric or loss. A report the database cannot take is said
    in the log and the run goes on."""

    def __init__(self) -> None:
        super().__init__()
        spec = os.environ.get(TRIAL_ENV)
        if not spec:
            raise ValueError(f"{type(self).__name__} reports to a {PROG} trial: it is added by {PROG} "
                             f"(no {TRIAL_ENV} in the environment)")
        self.spec = json.loads(spec)
        self._trial = None
        self._validations = 0

    def trial(self):
        """``(study, storage, the trial's id in the storage)``, opened on first use."""
        if self._trial is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            storage = optuna.storages.RDBStorage(self.spec["storage"])
            study = optuna.load_study(study_name=self.spec["study"], storage=storage,
                                      pruner=make_pruner(self.spec["pruner"]))
            study_id = storage.get_study_id_from_name(study.study_name)  # the fit knows its trial by number
            self._trial = study, storage, storage.get_trial_id_from_study_id_trial_number(study_id, self.spec["trial"])
        return self._trial

    def report(self, value: float, step: int) -> bool:
        """``value`` recorded at ``step``; whether the pruner says to stop (not at a non-finite one)."""
        study, storage, trial_id = self.trial()
        storage.set_trial_intermediate_value(trial_id, step, value)
        return math.isfinite(value) and study.pruner.prune(study, storage.get_trial(trial_id))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        value = trainer.callback_metrics.get(self.spec["monitor"])
        if value is None:
            return
        value, step = float(value), self._validations
        self._validations += 1
        monitor = self.spec["monitor"]
        from optuna.exceptions import StorageInternalError
        from sqlalchemy.exc import SQLAlchemyError

        try:
            prune = self.report(value, step)
        except (StorageInternalError, SQLAlchemyError) as exc:  # a busy or locked database: the run goes on
            prune = False
            print(f"{PROG}: validation {step}: {monitor} {value:.6g} could not be reported to the study "
                  f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); not pruned here",
                  file=sys.stderr, flush=True)
        if not math.isfinite(value):
            trainer.should_stop = True
            self.diverged(trainer, f"{monitor} is {value} at validation {step}; the run was stopped there",
                          step)
        elif prune:
            trainer.should_stop = True
            self.mark(trainer, PRUNED_MARKER, {"validation": step, monitor: value})

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, FloatingPointError):  # the training step's divergence
            self.diverged(trainer, " ".join(str(exception).split()), None)

    def diverged(self, trainer, reason: str, validation: int | None) -> None:
        self.mark(trainer, DIVERGED_MARKER, {"validation": validation, "reason": reason})

    def mark(self, trainer, name: str, value: dict) -> None:
        with atomic_write(Path(trainer.default_root_dir, name)) as handle:
            json.dump(value, handle)

