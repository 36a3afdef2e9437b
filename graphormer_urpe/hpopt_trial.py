"""The callback in every trial's ``fit`` of ``graphormer-urpe-hpopt`` (:mod:`graphormer_urpe.hpopt`
adds it as ``--trainer.callbacks+=graphormer_urpe.hpopt_trial.ReportToTrial``): it reports the
task's validation metric to the Optuna trial and stops the run when the study's pruner says so.
Apart from :mod:`graphormer_urpe.hpopt` so that the search command starts without Lightning."""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import signal
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from graphormer_urpe.hpopt import PROG, PRUNED_MARKER, TRIAL_ENV, make_pruner


class ReportToTrial(Callback):
    """Inside a trial's ``fit``: after each validation, reports the task's validation metric to
    the trial (step = the number of the validation: 0, 1, ...) and, when the study's pruner says
    so, stops the run and writes ``pruned.json`` into the run directory. Also ends the run when
    the search that started it dies. The trial comes from :data:`TRIAL_ENV`."""

    def __init__(self) -> None:
        super().__init__()
        spec = os.environ.get(TRIAL_ENV)
        if not spec:
            raise ValueError(f"{type(self).__name__} reports to a {PROG} trial: it is added by {PROG} "
                             f"(no {TRIAL_ENV} in the environment)")
        self.spec = json.loads(spec)
        _end_with_parent(int(self.spec["parent"]))
        self._trial = None
        self._validations = 0

    def trial(self):
        if self._trial is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = optuna.load_study(study_name=self.spec["study"], storage=self.spec["storage"],
                                      pruner=make_pruner(self.spec["pruner"]))
            self._trial = optuna.trial.Trial(study, self.spec["trial_id"])
        return self._trial

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        value = trainer.callback_metrics.get(self.spec["monitor"])
        if value is None:
            return
        value, step = float(value), self._validations
        self._validations += 1
        if not math.isfinite(value):
            return
        trial = self.trial()
        trial.report(value, step)
        if trial.should_prune():
            trainer.should_stop = True
            Path(trainer.default_root_dir, PRUNED_MARKER).write_text(
                json.dumps({"validation": step, self.spec["monitor"]: value}) + "\n")


def _end_with_parent(parent: int) -> None:
    """On Linux: this process gets SIGTERM when the search that started it dies (the fit
    stops after its step in progress, as on any SIGTERM); it stops now if it already did."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        raise SystemExit(f"{PROG}: the search that started this trial has ended")
