"""The study database of ``graphormer-urpe-hpopt``: opened (and created) under a lock beside a
SQLite database, checked against the recipe it was created with, its reads and writes tried
again while it is busy, each running trial's heartbeat, and the trials whose worker died failed
with their values queued again.

Optuna is used through its public API: ``optuna.create_study`` / ``load_study``, ``Study.ask`` /
``tell``, ``optuna.storages.fail_stale_trials`` and ``RetryHeartbeatStaleTrialCallback``, and the
documented methods of ``optuna.storages.RDBStorage`` where another process must reach a running
trial by its number (:func:`trial_id`: its heartbeat here, its reports in the trial's ``fit``).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import filelock

from graphormer_urpe.training.studies.search_space import Refused, one_line

#: The study's user attribute that holds its recipe and search space.
RECIPE_ATTR = "recipe"
#: A worker's heartbeat (seconds) and how old it may get before its running trial counts as dead.
HEARTBEAT_S, GRACE_S = 60, 300
#: How long a read or write of the study database is tried again while the database is busy
#: (another worker's write, a lock another program holds) before the search stops in one line.
STORAGE_WAIT_S = 30


class StorageFailed(RuntimeError):
    """The study database failed a read or write (locked by another program past
    :data:`STORAGE_WAIT_S`, gone, full): the search stops in one line."""


def safe_url(url: str) -> str:
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
            raise ValueError(f"{option} {safe_url(url)}: cannot open the study database (its folder "
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
    lock = filelock.FileLock(f"{database}.lock")  # the kernel drops it when the process ends
    try:
        lock.acquire()
    except OSError as exc:
        raise Refused(f"{database}.lock (the study database's lock) cannot be written "
                      f"({exc.strerror or exc})") from None
    try:
        yield
    finally:
        lock.release()


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
            raise Refused(f"--storage {safe_url(url)}: cannot open the study database "
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
                raise StorageFailed(f"{what}: {storage_error(exc)}") from None
            time.sleep(1)


def storage_error(exc: BaseException) -> str:
    """Why the study database failed, in one line: a :class:`StorageFailed`'s message, or the
    database driver's own error behind Optuna's storage error."""
    if isinstance(exc, StorageFailed):
        return str(exc)
    cause = exc.__cause__ or exc
    cause = getattr(cause, "orig", None) or cause  # SQLAlchemy's wrapper: the driver's message
    return f"{type(cause).__name__}: {one_line(cause)}"


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
        raise Refused(f"{option} {database or safe_url(url)}: the study database cannot be used "
                      f"({storage_error(exc)})") from None


def trial_id(storage, study_name: str, number: int) -> int:
    """The storage's id of trial ``number`` of study ``study_name`` (what its heartbeat and its
    reports are recorded under: a trial is known to other processes by its number)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)


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
