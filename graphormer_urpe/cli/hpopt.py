"""``graphormer-urpe-hpopt``: hyperparameter search with Optuna over any LightningCLI key.

    graphormer-urpe-hpopt --space space.yaml --config configs/csv.yaml --study esol \\
        --n-trials 20 [--timeout 30m] [LightningCLI overrides for every trial, e.g. --trainer.max_epochs 10]

The search space is a YAML mapping from a ``graphormer-urpe fit`` key to its range::

    model.lr: {type: float, low: 1e-5, high: 1e-3, log: true}
    model.backbone.num_layers: {type: int, low: 2, high: 6}
    model.backbone.dropout: {type: categorical, choices: [0.0, 0.1]}

Each trial is an ordinary ``graphormer-urpe fit`` in its own process and run directory,
``<runs-dir>/<study>/trial-<n>``: the recipe (``--config`` files, then the overrides), then the
trial's values as one more config file (``trial-<n>/params.yaml``). Its objective is the best
value of the task's validation metric (``val/mae`` for regression, minimised; ``val/auroc`` /
``val/accuracy`` maximised), read from the run's checkpoints. A callback in the trial
(:data:`TRIAL_CALLBACK`, given the study and trial through :data:`TRIAL_ENV`) reports the metric
after each validation, and stops the run when the pruner says so (the trial is then *pruned*).
A run that diverges (a non-finite validation metric, or a fit stopped by non-finite losses) is
pruned too, with the reason, and has no value.

The study lives in an Optuna database, by default ``sqlite:///<runs-dir>/<study>/study.db``;
any Optuna database URL (``--storage postgresql://...``) lets workers on several machines share
one study; workers started together on a new SQLite study take turns creating it. It records its
recipe and search space: a run with another recipe is refused. ``--n-trials N`` runs until the
study holds N finished (complete or pruned) trials, counting earlier runs and other workers;
``--timeout`` starts no trial after that time from the command's start. Killed and rerun, a
search keeps its finished trials; a trial that was running when its worker died is marked failed
and its values queued again (at once when the worker ran on this machine, else once its
heartbeat is older than the grace period). Stopped by SIGTERM, SIGHUP or Ctrl-C, the search ends
the trial's fit, marks the trial failed with its values queued again, and says so in one line.
The best trial so far is written as ``<runs-dir>/<study>/best.yaml``, a config for
``graphormer-urpe fit --config base.yaml --config best.yaml``, after every complete trial;
``trials.csv`` beside it lists them all.

Bad input (an unknown key, a bad range, a key written twice, a value ``fit`` refuses, another
study's recipe, a study name that is not a plain name, a database that cannot be opened or
written) is one line on stderr and exit status 2, before any trial runs. A study database that
fails during the search (locked by another program for :data:`STORAGE_WAIT_S`) ends it in one
line naming the trial left running, which the same command run again fails and runs again.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from graphormer_urpe.utils.process import STOP_SIGNALS
from graphormer_urpe.training.recipes import resolve_config

PROG = "graphormer-urpe-hpopt"
#: The trial's study, storage and pruner, as JSON, in the environment of a trial's ``fit``.
TRIAL_ENV = "GRAPHORMER_URPE_HPOPT_TRIAL"
STUDY_DB = "study.db"
BEST_CONFIG = "best.yaml"
TRIALS_TABLE = "trials.csv"
PARAMS_CONFIG = "params.yaml"
FIT_LOG = "fit.log"
#: The callback added to every trial's fit (:class:`graphormer_urpe.training.studies.search_trial.ReportToTrial`).
TRIAL_CALLBACK = "graphormer_urpe.training.studies.search_trial.ReportToTrial"
#: Written into a trial's run directory by the trial's callback when the pruner stopped it.
PRUNED_MARKER = "pruned.json"
#: Written there when the run diverged (a non-finite validation metric, or a fit stopped by
#: non-finite losses): the trial is recorded as pruned, with the reason.
DIVERGED_MARKER = "diverged.json"
#: The study's user attribute that holds its recipe and search space.
RECIPE_ATTR = "recipe"
#: Keys the search sets itself in every trial.
OWN_KEYS = ("trainer.default_root_dir", "ckpt_path")
#: A worker's heartbeat (seconds) and how old it may get before its running trial counts as dead.
HEARTBEAT_S, GRACE_S = 60, 300
#: How long a read or write of the study database is tried again while the database is busy
#: (another worker's write, a lock another program holds) before the search stops in one line.
STORAGE_WAIT_S = 30
#: The search stops after this many failed trials in a row (a recipe that cannot train).
MAX_FAILURES_IN_A_ROW = 3
KINDS = ("float", "int", "categorical")


class Refused(ValueError):
    """Bad input: one line on stderr, exit status 2."""


class TrialFailed(RuntimeError):
    """A trial's ``fit`` failed (its log says why); the study records the trial as failed."""


# ---------------------------------------------------------------- the search space


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats: ``1e-5`` is a number (PyYAML's YAML 1.1 reads it as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.inf|\.Inf|\.INF|\.nan|\.NaN|\.NAN)$"),
    list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """Floats always with a dot (``1.0e-05``), so that every YAML reader sees a number."""


def _represent_float(dumper: yaml.SafeDumper, value: float):
    text = repr(float(value))
    if "e" in text and "." not in text:
        text = text.replace("e", ".0e")
    if not math.isfinite(value):
        return dumper.represent_float(value)
    return dumper.represent_scalar("tag:yaml.org,2002:float", text)


_Dumper.add_representer(float, _represent_float)


@dataclass(frozen=True)
class Param:
    """One key's range: ``float`` / ``int`` between ``low`` and ``high`` (``log`` scale or a
    ``step``), or ``categorical`` ``choices`` (finite numbers, strings, booleans, null)."""

    key: str
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple | None = None
    #: Where the key is written (``--space FILE, line N: KEY``), to name it in a refusal; not
    #: part of the recipe a study records.
    where: str = field(default="", compare=False, repr=False)

    def suggest(self, trial) -> Any:
        """This key's value in an Optuna trial."""
        if self.type == "categorical":
            return trial.suggest_categorical(self.key, self.choices)
        if self.type == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def probes(self) -> list:
        """The values whose config must parse: both ends, or every choice."""
        return list(self.choices) if self.type == "categorical" else [self.low, self.high]

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                if k not in ("key", "where") and v not in (None, False)}


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _number(where: str, name: str, value: Any, integer: bool) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise Refused(f"{where}: {name} must be a finite number, got {value!r}")
    if integer and value != int(value):
        raise Refused(f"{where}: {name} must be an integer for type int, got {value!r}")
    return int(value) if integer else float(value)


def parse_param(key: str, spec: Any, where: str = "") -> Param:
    """One entry of the search space, checked (:class:`Refused` starting with ``where``, which
    names the key and where it is written)."""
    where = where or f"search space {key}"
    if not isinstance(spec, dict):
        raise Refused(f"{where}: expected a mapping such as {{type: float, low: 1e-5, "
                      f"high: 1e-3}}, got {spec!r}")
    kind = spec.get("type")
    if kind not in KINDS:
        raise Refused(f"{where}: type must be one of {list(KINDS)}, got {kind!r}")
    allowed = {"type", "choices"} if kind == "categorical" else {"type", "low", "high", "log", "step"}
    unknown = sorted(map(str, set(spec) - allowed))
    if unknown:
        raise Refused(f"{where}: unknown field(s) {unknown} for type {kind} (allowed: {sorted(allowed)})")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise Refused(f"{where}: choices must be a non-empty list, got {choices!r}")
        bad = [c for c in choices if c is not None and not (isinstance(c, (bool, int, float, str)) and _finite(c))]
        if bad:
            raise Refused(f"{where}: choices must be finite numbers, strings, booleans or null, got {bad[0]!r}")
        if len({json.dumps(c) for c in choices}) != len(choices):
            raise Refused(f"{where}: choices repeat a value: {choices!r}")
        return Param(key, kind, choices=tuple(choices), where=where)
    for name in ("low", "high"):
        if name not in spec:
            raise Refused(f"{where}: type {kind} needs low and high")
    integer = kind == "int"
    low, high = (_number(where, name, spec[name], integer) for name in ("low", "high"))
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise Refused(f"{where}: log must be true or false, got {log!r}")
    step = spec.get("step")
    if step is not None:
        step = _number(where, "step", step, integer)
        if step <= 0:
            raise Refused(f"{where}: step must be > 0, got {step!r}")
        if log:
            raise Refused(f"{where}: step and log cannot be combined")
    if not low < high:
        raise Refused(f"{where}: low must be below high, got low={low!r}, high={high!r}")
    if log and low <= 0:
        raise Refused(f"{where}: a log range needs low > 0, got low={low!r}")
    return Param(key, kind, low, high, log, step, where=where)


def _refuse_repeated_keys(path: Path, node: yaml.Node, parent: str | None = None) -> None:
    """A key written twice in one mapping of the space file (YAML would keep the last silently),
    refused naming the file, the key and both lines."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_repeated_keys(path, item, parent)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        if key is not None and key in seen:
            what = f"{parent}: field {key!r}" if parent else key
            raise Refused(f"--space {path}, line {line}: {what} is written twice (first on line "
                          f"{seen[key]}; YAML would keep only the last): write it once")
        if key is not None:
            seen[key] = line
        _refuse_repeated_keys(path, value_node, parent or key)


def read_space(path: Path) -> dict[str, Param]:
    """The search space file: a mapping of dotted ``fit`` keys to ranges. A refusal names the
    file, the line and the key."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise Refused(f"--space {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise Refused(f"--space {path}: not a text file") from None
    try:
        root = yaml.compose(text, Loader=_Loader)
        space = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise Refused(f"--space {path}: not YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(space, dict) or not space:
        raise Refused(f"--space {path}: expected a non-empty mapping of fit keys to ranges, e.g. "
                      "'model.lr: {type: float, low: 1e-5, high: 1e-3, log: true}'")
    _refuse_repeated_keys(path, root)
    lines = {node.value: node.start_mark.line + 1 for node, _ in root.value if isinstance(node, yaml.ScalarNode)}
    params = {}
    for key, spec in space.items():
        line = lines.get(str(key))
        where = f"--space {path}{f', line {line}' if line else ''}: {key}"
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
            raise Refused(f"{where}: not a dotted fit key such as model.lr")
        if key.removeprefix("fit.") in OWN_KEYS:
            raise Refused(f"{where}: the search sets it for every trial")
        params[key] = parse_param(key, spec, where)
    return params


def nested(values: dict[str, Any]) -> dict:
    """``{"model.backbone.dropout": 0.1}`` -> ``{"model": {"backbone": {"dropout": 0.1}}}``."""
    tree: dict = {}
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def config_text(values: dict[str, Any]) -> str:
    return yaml.dump(nested(values), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def duration(text: str) -> float:
    """``--timeout``: seconds, or ``1h30m``, ``30m``, ``90s``, ``2h``."""
    match = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*",
                         text)
    if not text.strip() or match is None:
        raise argparse.ArgumentTypeError(f"expected a duration such as 30m, 1h30m, 90s or 600, got {text!r}")
    hours, minutes, seconds = (float(group or 0) for group in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return total


# ---------------------------------------------------------------- the recipe


def override_keys(overrides: list[str]) -> list[str]:
    """The keys the pass-through overrides set (``--key value`` / ``--key=value``)."""
    return [arg[2:].split("=", 1)[0] for arg in overrides if arg.startswith("--") and len(arg) > 2]


def check_overrides(overrides: list[str], space: dict[str, Param]) -> None:
    for key in override_keys(overrides):
        if key.removeprefix("fit.") in OWN_KEYS:
            raise Refused(f"--{key}: the search sets it for every trial (trials run in "
                          "<runs-dir>/<study>/trial-<n>)")
        if key in space:
            raise Refused(f"--{key} is both an override and a search space key: drop one")


class _Parsed(Exception):
    def __init__(self, config) -> None:
        super().__init__("parsed")
        self.config = config


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500] or type(exc).__name__


def parse_fit(args: list[str]):
    """``graphormer-urpe fit``'s parsed config for ``args``, built by its own parser and checked
    by the checks ``fit`` makes before it reads any data (the schedule, ``trainer.max_steps``,
    the training step's trainer settings); nothing is instantiated, no data read.
    :class:`Refused` with the parser's or the check's message."""
    import lightning.pytorch as pl

    from graphormer_urpe.training.lightning_cli import GraphormerCLI
    from graphormer_urpe.training.fit_checks import check_schedule_config, check_step_config
    from graphormer_urpe.training.module import GraphormerModule

    class ParseOnly(GraphormerCLI):
        def _parse_ckpt_path(self) -> None:  # right after parsing: stop before seeding, building
            raise _Parsed(self.config)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ParseOnly(GraphormerModule, pl.LightningDataModule, subclass_mode_data=True,
                      parser_kwargs={"exit_on_error": False}, args=["fit", *args])
        except _Parsed as parsed:
            config = parsed.config.fit
        except Exception as exc:  # noqa: BLE001 - the parser's errors come in several types
            raise Refused(_one_line(exc)) from None
        else:
            raise RuntimeError("LightningCLI did not stop after parsing")
    try:
        check_schedule_config(config)
        check_step_config(config.trainer)
    except ValueError as exc:
        raise Refused(_one_line(exc)) from None
    return config


def check_recipe(configs: list[str], overrides: list[str], space: dict[str, Param]) -> dict:
    """The recipe parses with both ends of every range and every choice set on it (one parse
    per probe, all keys at once; on a failure, each key alone names the culprit); returns the
    objective, the task's validation metric and whether it is minimised or maximised."""
    from graphormer_urpe.data.task import get_task
    from graphormer_urpe.training.lightning_cli import _data_task

    recipe = [arg for path in configs for arg in ("--config", path)] + list(overrides)
    with tempfile.TemporaryDirectory(prefix="hpopt-check-") as scratch:
        probe = Path(scratch) / PARAMS_CONFIG

        def parse(values: dict):
            probe.write_text(config_text(values))
            return parse_fit([*recipe, "--config", str(probe)])

        probes = {key: param.probes() for key, param in space.items()}
        for i in range(max(map(len, probes.values()))):
            values = {key: values[i % len(values)] for key, values in probes.items()}
            try:
                config = parse(values)
            except Refused as together:
                try:
                    parse_fit(recipe)
                except Refused as exc:
                    raise Refused("the recipe (--config files and overrides) is not accepted by "
                                  f"graphormer-urpe fit: {exc}") from None
                for key, value in values.items():
                    try:
                        parse({key: value})
                    except Refused as exc:
                        raise Refused(f"{space[key].where}: {value!r} is not accepted by graphormer-urpe "
                                      f"fit: {exc}") from None
                raise Refused(f"search space values {values} are not accepted together by "
                              f"graphormer-urpe fit: {together}") from None
    task = get_task(_data_task(config.data))
    return {"monitor": task.monitor, "mode": task.mode}


def recipe_record(configs: list[str], overrides: list[str], space: dict[str, Param]) -> dict:
    """What a study is tied to: the config files' contents, the overrides and the search space
    (stored in the study with the objective; another run of the study must bring the same)."""
    texts = []
    for path in configs:
        try:
            texts.append(Path(path).read_text())
        except OSError as exc:
            raise Refused(f"--config {path}: {exc.strerror or exc}") from None
    return {"configs": texts, "overrides": list(overrides),
            "space": {key: param.as_dict() for key, param in space.items()}}


# ---------------------------------------------------------------- the study


class StorageFailed(RuntimeError):
    """The study database failed a read or write (locked by another program past
    :data:`STORAGE_WAIT_S`, gone, full): the search stops in one line."""


def _safe_url(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a URL that does not parse is shown as given
        return url


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL (None: another database, or SQLite in memory)."""
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - open_storage names a URL that does not parse
        return None
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:" \
            or database.startswith("file:"):
        return None
    return Path(database).absolute()


def check_writable(study_dir: Path, url: str, option: str) -> None:
    """Before any trial (and before the recipe's check): the study folder, where the trials
    run, and a SQLite study database with its folder (SQLite writes its journal beside it) can
    be written; :class:`Refused` naming the path that cannot."""
    from graphormer_urpe.utils.files import check_creatable_dir, check_writable_dir

    try:
        if study_dir.is_dir():
            check_writable_dir(study_dir, "the study folder")
        else:
            check_creatable_dir(study_dir, "the study folder")
        database = sqlite_file(url)
        if database is None:
            return
        if database.exists() and not os.access(database, os.R_OK | os.W_OK):
            raise ValueError(f"{option} {database} cannot be written (the study database is read-only)")
        if database.parent.is_dir():
            check_writable_dir(database.parent, f"{option} {database}: its folder")
        elif database.parent != study_dir:  # a typo in --storage is not a new folder
            raise ValueError(f"{option} {_safe_url(url)}: cannot open the study database (its folder "
                             f"{database.parent} does not exist)")
    except ValueError as exc:
        raise Refused(str(exc)) from None


@contextlib.contextmanager
def creating(url: str) -> Iterator[None]:
    """Around opening (and creating) a study database and its study: workers started together
    on a new SQLite study take turns (an exclusive lock on ``<database>.lock`` beside it), or
    the first would create the tables while the second finds them half made ("table ...
    already exists"). Another database is created in one transaction by its server."""
    database = sqlite_file(url)
    if database is None:
        yield
        return
    try:
        handle = open(f"{database}.lock", "a")
    except OSError as exc:
        raise Refused(f"{database}.lock (the study database's lock) cannot be written "
                      f"({exc.strerror or exc})") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        yield


def open_storage(url: str):
    """The study database (heartbeat on; a trial whose worker stopped beating is failed and its
    values queued once more); :class:`Refused` when it cannot be opened."""
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # heartbeats are "experimental"
        try:
            return RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                              heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1))
        except Exception as exc:  # noqa: BLE001 - bad URLs, missing drivers, unreachable servers
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise Refused(f"--storage {_safe_url(url)}: cannot open the study database "
                          f"({type(exc).__name__}: {first})") from None
        finally:
            optuna.logging.set_verbosity(optuna.logging.WARNING)


def retried(what: str, call: Callable[..., Any], *args, **kwargs) -> Any:
    """``call(*args, **kwargs)``, a read or write of the study database, tried again for up to
    :data:`STORAGE_WAIT_S` while the database is busy (a lock another worker or program holds);
    then :class:`StorageFailed` saying ``what`` could not be done, and why."""
    from optuna.exceptions import StorageInternalError

    deadline = time.monotonic() + STORAGE_WAIT_S
    while True:
        try:
            return call(*args, **kwargs)
        except StorageInternalError as exc:
            if time.monotonic() >= deadline:
                raise StorageFailed(f"{what}: {_storage_error(exc)}") from None
            time.sleep(1)


def _storage_error(exc: BaseException) -> str:
    """The database driver's own error behind a storage error, in one line."""
    cause = exc.__cause__ or exc
    cause = getattr(cause, "orig", None) or cause  # SQLAlchemy's wrapper: the driver's message
    return f"{type(cause).__name__}: {_one_line(cause)}"


def _differences(stored: dict, ours: dict) -> list[str]:
    names = {"configs": "--config files' contents", "overrides": "overrides", "space": "search space"}
    return [names[key] for key in names if stored.get(key) != ours.get(key)]


def stored_recipe(storage, name: str, recipe: dict) -> dict | None:
    """The recipe study ``name`` holds (None: no such study yet); :class:`Refused` when it is
    not ``recipe`` (objective aside: it follows from the recipe)."""
    import optuna

    if name not in optuna.get_all_study_names(storage):
        return None
    stored = optuna.load_study(study_name=name, storage=storage).user_attrs.get(RECIPE_ATTR)
    if stored is not None and _differences(stored, recipe):
        raise Refused(f"study {name!r} was created with another recipe (different: "
                      f"{', '.join(_differences(stored, recipe))}): run it with the recipe it was "
                      "created with, or name a new --study")
    return stored


def open_study(storage, name: str, recipe: dict, pruner, study_dir: Path):
    """The study ``name`` in ``storage``: created with ``recipe`` (refused when ``study_dir``
    already holds trial directories: another study's), or loaded and compared with it."""
    import optuna

    if stored_recipe(storage, name, recipe) is None:
        old = sorted(p.name for p in study_dir.glob("trial-*")) if study_dir.is_dir() else []
        if old:
            raise Refused(f"{study_dir} holds trial directories ({', '.join(old[:3])}...) but the "
                          f"database has no study {name!r}: another study's runs; choose another "
                          "--study or --runs-dir, or the database that holds it (--storage)")
    direction = "maximize" if recipe["objective"]["mode"] == "max" else "minimize"
    study = optuna.create_study(storage=storage, study_name=name, direction=direction,
                                pruner=pruner, load_if_exists=True)
    if study.user_attrs.get(RECIPE_ATTR) is None:
        study.set_user_attr(RECIPE_ATTR, recipe)
    stored_recipe(storage, name, recipe)  # another worker may have created it meanwhile
    return study


def connect(url: str, name: str, recipe: dict, check: Callable[[], dict], pruner, study_dir: Path,
            option: str):
    """``(storage, study)``: the database opened and the study loaded, or created with
    ``recipe`` after ``check()`` gave its objective (the recipe's check, run only for a new
    study: an existing study's recipe was checked when it was created); workers started
    together take turns (:func:`creating`). A database that fails a read or write (read-only,
    a server that refuses) is :class:`Refused` naming it."""
    from optuna.exceptions import StorageInternalError

    database = sqlite_file(url)
    try:
        storage = stored = None
        if database is None or database.is_file():  # an existing database: quick to refuse
            with creating(url):
                storage = open_storage(url)
                stored = stored_recipe(storage, name, recipe)
        recipe["objective"] = stored["objective"] if stored else check()
        study_dir.mkdir(parents=True, exist_ok=True)
        with creating(url):
            storage = storage or open_storage(url)
            return storage, open_study(storage, name, recipe, pruner, study_dir)
    except StorageInternalError as exc:
        raise Refused(f"{option} {database or _safe_url(url)}: the study database cannot be used "
                      f"({_storage_error(exc)})") from None


def storage_trial_id(storage, study, number: int) -> int:
    """The storage's id of trial ``number`` of ``study`` (what its heartbeat is recorded under)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name),
                                                           number)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fail_and_queue_again(study, number: int) -> bool:
    """Trial ``number``, still running, is marked failed and its values queued to run once more
    (as the heartbeat does for a trial whose worker stopped beating); False when it had
    already finished (another worker got there first)."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    try:
        failed = study.tell(number, state=TrialState.FAIL)
    except (UpdateFinishedTrialError, ValueError):  # finished meanwhile
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental"
        RetryHeartbeatStaleTrialCallback(max_retry=1)(study, failed)
    return True


def fail_dead_trials(study) -> list[int]:
    """Running trials whose worker ran on this machine and is gone, or that never recorded a
    worker (it died as the trial began) and started over :data:`GRACE_S` ago, are marked failed
    and their values queued once more (as the heartbeat does for other machines' after the
    grace period)."""
    from optuna.trial import TrialState

    host, now = socket.gethostname(), datetime.datetime.now()
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker")
        if worker is None:
            dead = trial.datetime_start is not None and (now - trial.datetime_start).total_seconds() > GRACE_S
        else:
            worker_host, _, pid = str(worker).rpartition(":")
            dead = worker_host == host and pid.isdigit() and not _alive(int(pid))
        if dead and fail_and_queue_again(study, trial.number):
            failed.append(trial.number)
    return failed


@contextlib.contextmanager
def heartbeat(storage, trial: int) -> Iterator[None]:
    """The trial's heartbeat, recorded every :data:`HEARTBEAT_S` while the block runs: a worker
    on another machine fails the trial once it is :data:`GRACE_S` old (this worker was killed)."""
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):  # a busy database: the next beat, or the grace period
                storage.record_heartbeat(trial)
            if stop.wait(HEARTBEAT_S):
                return

    thread = threading.Thread(target=beat, name="hpopt-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=STORAGE_WAIT_S)


def make_sampler(name: str, seed: int | None, startup_trials: int, offset: int):
    import optuna

    seed = None if seed is None else seed + offset  # a resumed search does not redraw the same values
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials)


def make_pruner(spec: dict):
    import optuna

    if spec["name"] == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=spec["startup_trials"],
                                       n_warmup_steps=spec["warmup_validations"])


def best_config(study, recipe_line: str) -> str | None:
    """``best.yaml``'s text: the best complete trial's values, with a header saying where they
    come from and how to train with them; None without a complete trial."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return None
    best = study.best_trial
    monitor = study.user_attrs[RECIPE_ATTR]["objective"]["monitor"]
    header = [f"{PROG}: study {study.study_name!r}, the best of {len(complete)} complete trial(s):",
              f"trial {best.number}, best {monitor} {best.value:.6g} "
              f"({best.user_attrs.get('best_checkpoint', 'run ' + str(best.user_attrs.get('run_dir')))})",
              "Train with it: graphormer-urpe " + recipe_line]
    return "".join(f"# {line}\n" for line in header) + config_text(best.params)


def write_outputs(study, study_dir: Path, recipe_line: str) -> None:
    from graphormer_urpe.utils.files import atomic_write

    text = best_config(study, recipe_line)
    if text is not None:
        with atomic_write(study_dir / BEST_CONFIG) as handle:
            handle.write(text)
    table = study.trials_dataframe(attrs=("number", "value", "state", "params", "duration", "user_attrs"))
    with atomic_write(study_dir / TRIALS_TABLE) as handle:
        table.to_csv(handle, index=False)


# ---------------------------------------------------------------- one trial


def fit_command() -> list[str]:
    script = Path(sys.executable).with_name("graphormer-urpe")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "graphormer_urpe.cli.fit"]


@dataclass
class Search:
    """What every trial of this worker shares."""

    configs: list[str]
    overrides: list[str]
    space: dict[str, Param]
    study_dir: Path
    storage_url: str
    pruner: dict
    monitor: str

    def fit_args(self, params_file: Path, run_dir: Path) -> list[str]:
        return ["fit", *[a for path in self.configs for a in ("--config", path)], *self.overrides,
                "--config", str(params_file), "--trainer.default_root_dir", str(run_dir),
                f"--trainer.callbacks+={TRIAL_CALLBACK}"]

    def recipe_line(self) -> str:
        return shlex.join(["fit", *[a for path in self.configs for a in ("--config", path)], *self.overrides,
                           "--config", str(self.study_dir / BEST_CONFIG)])

    def objective(self, trial) -> float:
        """Trial ``trial``'s fit, run to its end: its objective; ``optuna.TrialPruned`` when the
        pruner stopped it or it diverged (a non-finite validation metric, or every step of a
        logging interval non-finite), :class:`TrialFailed` when its fit failed otherwise."""
        import optuna

        from graphormer_urpe.utils.torch_files import CheckpointError
        from graphormer_urpe.utils.files import read_json
        from graphormer_urpe.prediction.load import best_checkpoint

        number = trial.number
        retried(f"trial {number}: recording its worker", trial.set_user_attr, "worker",
                f"{socket.gethostname()}:{os.getpid()}")
        values = {key: retried(f"trial {number}: drawing {key}", param.suggest, trial)
                  for key, param in self.space.items()}
        run_dir = self.study_dir / f"trial-{number}"
        run_dir.mkdir(parents=True, exist_ok=True)
        retried(f"trial {number}: recording its run directory", trial.set_user_attr, "run_dir", str(run_dir))
        params_file = run_dir / PARAMS_CONFIG
        params_file.write_text(config_text(values))
        env = {**os.environ, TRIAL_ENV: json.dumps({
            "storage": self.storage_url, "study": trial.study.study_name, "trial": number,
            "monitor": self.monitor, "pruner": self.pruner, "parent": os.getpid()})}
        log = run_dir / FIT_LOG
        with open(log, "w") as out:
            out.write(shlex.join([*fit_command(), *self.fit_args(params_file, run_dir)]) + "\n")
            out.flush()
            done = subprocess.run([*fit_command(), *self.fit_args(params_file, run_dir)], env=env,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        try:
            diverged = read_json(run_dir / DIVERGED_MARKER, None)
        except ValueError:
            diverged = {"reason": f"its {DIVERGED_MARKER} is damaged"}
        if diverged is not None:
            raise optuna.TrialPruned(f"diverged: {diverged.get('reason')}; see {log}")
        if done.returncode != 0:
            raise TrialFailed(f"graphormer-urpe fit exited with status {done.returncode}; see {log}")
        try:
            best, score, step, _, _ = best_checkpoint(run_dir)
        except CheckpointError as exc:
            raise TrialFailed(f"no best checkpoint: {exc}") from None
        if not math.isfinite(score):
            raise optuna.TrialPruned(f"diverged: its best {self.monitor} is {score}; see {log}")
        retried(f"trial {number}: recording its checkpoint", trial.set_user_attr, "best_checkpoint", str(best))
        retried(f"trial {number}: recording its checkpoint", trial.set_user_attr, "best_step", step)
        if (run_dir / PRUNED_MARKER).is_file():
            raise optuna.TrialPruned(f"stopped by the pruner; best {self.monitor} {score:.6g}")
        return score

    def run(self, study, storage, trial) -> tuple[Any, float | None, str | None]:
        """Trial ``trial`` run with its heartbeat: ``(its state, its value, why it failed or was
        pruned)``, the reason recorded in the trial (user attribute ``reason``). Any other error
        fails the trial before it is raised."""
        import optuna
        from optuna.trial import TrialState

        value, reason = None, None
        with heartbeat(storage, storage_trial_id(storage, study, trial.number)):
            try:
                value, state = self.objective(trial), TrialState.COMPLETE
            except optuna.TrialPruned as exc:
                state, reason = TrialState.PRUNED, str(exc)
            except TrialFailed as exc:
                state, reason = TrialState.FAIL, str(exc)
            except StorageFailed:  # the database cannot record the failure either
                raise
            except Exception as exc:  # noqa: BLE001 - a full disk, a bug: the trial fails, the error is raised
                with contextlib.suppress(Exception):
                    trial.set_user_attr("reason", f"{type(exc).__name__}: {_one_line(exc)}")
                    study.tell(trial, state=TrialState.FAIL)
                raise
        if reason is not None:
            retried(f"trial {trial.number}: recording why it ended", trial.set_user_attr, "reason", reason)
        return state, value, reason


# ---------------------------------------------------------------- the trials


def _trial_line(trial, monitor: str) -> str:
    took = f"{trial.duration.total_seconds():.0f} s" if trial.duration else "?"
    value = f"{monitor} {trial.value:.6g}" if trial.value is not None else (
        f"last reported {monitor} {list(trial.intermediate_values.values())[-1]:.6g}"
        if trial.intermediate_values else "no value")
    values = " ".join(f"{k}={v!r}" for k, v in trial.params.items())
    return f"trial {trial.number}: {trial.state.name.lower()}, {value} ({took}) {values}"


def _stopped(stop: BaseException, study, current: int | None) -> tuple[str, int]:
    """After SIGTERM, SIGHUP or Ctrl-C: the trial in progress (its fit already ended) is marked
    failed and its values queued to run again; the line that says so, and the exit status."""
    from optuna.exceptions import StorageInternalError

    from graphormer_urpe.utils.process import INTERRUPTED

    if isinstance(stop, KeyboardInterrupt):
        how, status = "Ctrl-C (SIGINT)", INTERRUPTED
    else:
        status = stop.code
        how = signal.Signals(status - 128).name
    resume = "run the same command again to resume"
    if current is None:
        return f"{PROG}: stopped by {how} between trials; the finished trials are kept: {resume}", status
    try:
        queued = retried(f"trial {current}: marking it failed", fail_and_queue_again, study, current)
    except (StorageFailed, StorageInternalError) as exc:
        why = str(exc) if isinstance(exc, StorageFailed) else _storage_error(exc)
        return (f"{PROG}: stopped by {how} during trial {current} (its fit is stopped); the study "
                f"database could not record it ({why}): it is left running, and the same "
                "command run again on this machine marks it failed and runs its values again", status)
    if not queued:
        return f"{PROG}: stopped by {how} as trial {current} ended; the finished trials are kept: {resume}", status
    return (f"{PROG}: stopped by {how} during trial {current} (its fit is stopped; the trial is marked "
            f"failed and its values queued to run again): {resume}", status)


def run_trials(study, storage, run: Search, n_trials: int | None, deadline: float | None) -> int:
    """Trials one after another until the study holds ``n_trials`` finished ones, the
    ``time.monotonic()`` deadline has passed, or :data:`MAX_FAILURES_IN_A_ROW` failed in a row; after each, its line
    and the outputs. A signal, Ctrl-C or a study database that fails ends the search in one line
    naming the trial in progress. Returns the exit status."""
    import optuna
    from optuna.exceptions import StorageInternalError
    from optuna.trial import TrialState

    finished = (TrialState.COMPLETE, TrialState.PRUNED)
    failures, current = 0, None
    try:
        while failures < MAX_FAILURES_IN_A_ROW:
            if n_trials is not None and len(retried("counting the finished trials", study.get_trials,
                                                    deepcopy=False, states=finished)) >= n_trials:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            with warnings.catch_warnings():  # heartbeats are "experimental", and meant for optimize()
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                warnings.filterwarnings("ignore", "Heartbeat of storage")  # heartbeat() beats for this loop
                retried("failing trials whose worker stopped beating", optuna.storages.fail_stale_trials, study)
                trial = retried("starting a trial", study.ask)
            current = trial.number
            state, value, reason = run.run(study, storage, trial)
            frozen = retried(f"trial {current}: recording its result ({state.name.lower()}"
                             f"{'' if value is None else f', {run.monitor} {value:.6g}'})",
                             study.tell, trial, value, state, skip_if_finished=True)
            current = None
            print(_trial_line(frozen, run.monitor), flush=True)
            if reason is not None:
                print(f"trial {frozen.number}: {reason}", flush=True)
            failures = failures + 1 if frozen.state == TrialState.FAIL else 0
            retried("writing best.yaml and trials.csv", write_outputs, study, run.study_dir, run.recipe_line())
    except (SystemExit, KeyboardInterrupt) as stop:
        if isinstance(stop, SystemExit) and not (isinstance(stop.code, int) and stop.code - 128 in STOP_SIGNALS):
            raise
        line, status = _stopped(stop, study, current)
        print(line, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            write_outputs(study, run.study_dir, run.recipe_line())
        return status
    except (StorageFailed, StorageInternalError) as exc:
        during = "" if current is None else (
            f"; trial {current} is left running: the same command run again on this machine marks it "
            "failed and runs its values again")
        why = str(exc) if isinstance(exc, StorageFailed) else _storage_error(exc)
        print(f"{PROG}: error: the study database {_safe_url(run.storage_url)} failed ({why}){during}",
              file=sys.stderr, flush=True)
        return 1
    if failures >= MAX_FAILURES_IN_A_ROW:
        print(f"{PROG}: error: {failures} trials in a row failed; see their {FIT_LOG} under {run.study_dir}",
              file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- the command


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every refusal
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False, description="Hyperparameter search with Optuna over any graphormer-urpe fit key: "
                                 "each trial one fit in its own run directory (docs/hpopt.md).",
                     usage=f"{PROG} --space SPACE.yaml --config RECIPE.yaml [--config ...] "
                           "(--n-trials N | --timeout T) [options] [fit overrides...]",
                     epilog="Other arguments are LightningCLI overrides for every trial's fit "
                            "(e.g. --trainer.max_epochs 10); after '--' everything is.")
    parser.add_argument("--space", type=Path, required=True, help="the search space (YAML)")
    parser.add_argument("--config", action="append", default=[], required=True,
                        help="the base recipe: a packaged recipe's name or a fit config file, repeatable, in order")
    parser.add_argument("--study", default="hpopt", help="the study's name (default: hpopt)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/hpopt"),
                        help="trials run in <runs-dir>/<study>/trial-<n> (default: runs/hpopt)")
    parser.add_argument("--storage", help="an Optuna database URL shared by all workers (default: "
                                          "sqlite:///<runs-dir>/<study>/study.db)")
    parser.add_argument("--n-trials", type=int, help="run until the study holds this many finished "
                                                     "(complete or pruned) trials")
    parser.add_argument("--timeout", type=duration, help="start no trial after this long (30m, 1h30m, 600)")
    parser.add_argument("--sampler", choices=("tpe", "random"), default="tpe")
    parser.add_argument("--seed", type=int, help="the sampler's seed (offset by the trials already "
                                                 "in the study, so a resumed search draws new values)")
    parser.add_argument("--startup-trials", type=int, default=5,
                        help="trials drawn at random before TPE models the space, and complete "
                             "trials before the pruner prunes (default: 5)")
    parser.add_argument("--pruner", choices=("median", "none"), default="median",
                        help="median: stop a trial whose metric is worse than the median of "
                             "earlier trials' at the same validation (default)")
    parser.add_argument("--warmup-validations", type=int, default=1,
                        help="validations of each trial that are never pruned (default: 1)")
    return parser


def parse_args(argv: list[str] | None):
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        at = argv.index("--")
        args, overrides = parser.parse_args(argv[:at]), argv[at + 1:]
    else:
        args, overrides = parser.parse_known_args(argv)
    if args.n_trials is None and args.timeout is None:
        parser.error("give --n-trials, --timeout or both")
    for name in ("n_trials", "startup_trials", "warmup_validations"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "n_trials" else 0):
            parser.error(f"--{name.replace('_', '-')} must be >= {1 if name == 'n_trials' else 0}, got {value}")
    try:
        args.config = [resolve_config(config) for config in args.config]
    except ValueError as error:
        parser.error(str(error))
    if not re.fullmatch(r"[\w.-]+", args.study) or args.study in (".", ".."):
        parser.error("--study must be a plain name (letters, digits, '.', '_', '-'; not '.' or '..': "
                     f"it is a folder in --runs-dir), got {args.study!r}")
    return args, overrides


def search(args, overrides: list[str]) -> int:
    import optuna
    from optuna.trial import TrialState

    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    space = read_space(args.space)
    check_overrides(overrides, space)
    for path in args.config:
        if not Path(path).is_file():
            raise Refused(f"--config {path}: no such file")
    configs = [str(Path(path).resolve()) for path in args.config]
    study_dir = args.runs_dir.resolve() / args.study
    url = args.storage or f"sqlite:///{study_dir / STUDY_DB}"
    option = "--storage" if args.storage else "the study database"
    check_writable(study_dir, url, option)
    recipe = recipe_record(configs, overrides, space)
    pruner_spec = {"name": args.pruner, "startup_trials": args.startup_trials,
                   "warmup_validations": args.warmup_validations}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage, study = connect(url, args.study, recipe, lambda: check_recipe(configs, overrides, space),
                             make_pruner(pruner_spec), study_dir, option)
    study.sampler = make_sampler(args.sampler, args.seed, args.startup_trials, len(study.trials))
    monitor, maximised = recipe["objective"]["monitor"], recipe["objective"]["mode"] == "max"
    run = Search(configs, overrides, space, study_dir, url, pruner_spec, monitor)

    for number in fail_dead_trials(study):
        print(f"trial {number}: its worker on this machine is gone; marked failed, its values queued again",
              flush=True)
    finished = (TrialState.COMPLETE, TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=finished))
    print(f"study {args.study!r} ({_safe_url(url)}): {done} finished trial(s); objective "
          f"{monitor} ({'maximised' if maximised else 'minimised'}); trials in {study_dir}",
          flush=True)
    status = run_trials(study, storage, run, args.n_trials, deadline)
    if status != 0:
        return status
    write_outputs(study, study_dir, run.recipe_line())
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        print(f"{PROG}: error: no complete trial yet; see the trials' {FIT_LOG} under {study_dir}",
              file=sys.stderr)
        return 1
    best = study.best_trial
    print(f"best: trial {best.number}, {monitor} {best.value:.6g}; config {study_dir / BEST_CONFIG} "
          f"(graphormer-urpe {run.recipe_line()})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from graphormer_urpe.utils.process import run_command

    args, overrides = parse_args(argv)

    def work() -> int:
        try:
            return search(args, overrides)
        except Refused as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2

    return run_command(PROG, work)


if __name__ == "__main__":
    sys.exit(main())
