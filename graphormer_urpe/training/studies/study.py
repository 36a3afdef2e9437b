"""What the search (``graphormer-urpe-hpopt``) and the ablation's grid (``graphormer-urpe-ablation``)
both run on: the one reader of a study's recipe (:func:`parse_fit`), the launcher of a trial's
``graphormer-urpe`` child, tied to this process, the Optuna study database, opened with Optuna's
heartbeat (a dead worker's trial is failed and, for the search, its values queued again), and the
generated blocks of a page (:func:`update_block`)."""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import filelock


#: A study's SQLite database in its folder (the search's default, the ablation's grid).
STUDY_DB = "study.db"
#: The study's user attribute that holds its recipe.
RECIPE_ATTR = "recipe"
#: A worker's heartbeat (seconds) and how old it may get before its running trial counts as dead.
HEARTBEAT_S, GRACE_S = 60, 300
#: How long a read or write of a SQLite study waits while another worker or program holds it.
STORAGE_WAIT_S = 30
#: How long a child stopped with SIGTERM (a fit saves at the end of its step) may take to end.
STOP_GRACE_S = 180.0
#: How often :func:`launch` calls its ``tick`` while the child runs.
TICK_S = 15.0
#: Times a page's block is written again when the page changed while it was written.
PAGE_TRIES = 5


class Refused(ValueError):
    """Bad input: one line on stderr, exit status 2."""


class StorageFailed(BaseException):
    """The study database failed during a trial. Not an ``Exception``: ``Study.optimize`` would
    record the trial in the failing database; it stays running for the next run to fail."""


def one_line(exc: BaseException) -> str:
    """An error's message in one line (at most 500 characters), or its type's name."""
    return " ".join(str(exc).split())[:500] or type(exc).__name__


def recipe_args(configs: list[str], overrides: list[str]) -> list[str]:
    """A study's recipe as ``graphormer-urpe fit`` arguments: each ``--config``, then the overrides."""
    return [arg for config in configs for arg in ("--config", config)] + list(overrides)


class _Parsed(Exception):
    def __init__(self, config) -> None:
        super().__init__("parsed")
        self.config = config


def parse_fit(args: list[str]):
    """``graphormer-urpe fit``'s parsed config for ``args`` by its own parser and pre-data checks
    (nothing built, no data read): the one reader of a study's recipe; :class:`Refused`."""
    import lightning.pytorch as pl

    from graphormer_urpe.training.lightning_cli import GraphormerCLI
    from graphormer_urpe.training.fit_checks import check_schedule_config, check_step_config
    from graphormer_urpe.training.module import GraphormerModule
    from graphormer_urpe.training.recipes import resolve_config_args

    class ParseOnly(GraphormerCLI):
        def _parse_ckpt_path(self) -> None:  # right after parsing: stop before seeding, building
            raise _Parsed(self.config)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            args = resolve_config_args(list(args))
            ParseOnly(GraphormerModule, pl.LightningDataModule, subclass_mode_data=True,
                      parser_kwargs={"exit_on_error": False}, args=["fit", *args])
        except _Parsed as parsed:
            config = parsed.config.fit
        except Exception as exc:  # noqa: BLE001 - the parser's errors come in several types
            raise Refused(one_line(exc)) from None
        else:
            raise RuntimeError("LightningCLI did not stop after parsing")
    try:
        check_schedule_config(config)
        check_step_config(config.trainer)
    except ValueError as exc:
        raise Refused(one_line(exc)) from None
    return config


def objective(config) -> dict:
    """What a study of the parsed recipe ``config`` optimises: its task's validation metric and mode."""
    from graphormer_urpe.data.task import get_task
    from graphormer_urpe.training.lightning_cli import data_task

    task = get_task(data_task(config.data))
    return {"monitor": task.monitor, "mode": task.mode}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def console_command(script: str, module: str) -> list[str]:
    """The command that runs console script ``script`` (code: ``module``): the script beside the
    interpreter, else ``python -m module`` without the current folder on the import path (a
    user's ``torchmetrics.py`` must not shadow the library); ``PYTHONPATH`` stays, unlike ``-I``."""
    installed = Path(sys.executable).with_name(script)
    if installed.is_file():
        return [str(installed)]
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    # -P is new in 3.11; -c puts the current folder first as ''
    return [sys.executable, "-c", "import runpy, sys; del sys.path[0]; "
                                  f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"]


def tied_to_parent(signum: int) -> Callable[[], None]:
    """A ``preexec_fn``: on Linux the child gets ``signum`` when this process dies
    (``PR_SET_PDEATHSIG``), at once if it died before the tie: a killed study leaves no fit running."""
    parent, prctl = os.getpid(), None
    if sys.platform.startswith("linux"):  # looked up here: the child only calls it
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def tie() -> None:  # pragma: no cover - runs in the child before exec
        if prctl is not None:
            prctl(1, signum)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)

    return tie


def _stop(child: subprocess.Popen) -> int:
    """SIGTERM to a running child (a fit saves at its step's end), SIGKILL :data:`STOP_GRACE_S` later."""
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
    try:
        return child.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def launch(stage: str, args: list[str], log: Path, env: dict, deadline: float | None = None,
           record: Callable[[float, int | None], None] = lambda seconds, status: None) -> tuple[int, bool]:
    """``graphormer-urpe <stage> <args>`` in a child tied to this process, its output appended to
    ``log``; stopped (:func:`_stop`) at the monotonic ``deadline`` or when this process is stopped
    (raised again after). ``record(seconds, None)`` every :data:`TICK_S`, ``record(seconds, status)``
    at the end. Returns ``(exit status, whether the deadline stopped it)``."""
    command = [*console_command("graphormer-urpe", "graphormer_urpe.cli.fit"), stage, *args]
    start, status = time.monotonic(), None
    with open(log, "a") as out:
        out.write(f"\n# {now()} {shlex.join(command)}\n")
        out.flush()
        child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 preexec_fn=tied_to_parent(signal.SIGTERM))
        try:
            while True:
                wait = TICK_S if deadline is None else min(TICK_S, max(deadline - time.monotonic(), 0.0))
                try:
                    status = child.wait(timeout=wait)
                    return status, False
                except subprocess.TimeoutExpired:
                    record(time.monotonic() - start, None)
                    if deadline is not None and time.monotonic() >= deadline:
                        status = _stop(child)
                        return status, True
        except BaseException:
            status = _stop(child)
            raise
        finally:
            record(time.monotonic() - start, status)


def _parsed(url: str):
    """SQLAlchemy's parse of ``url``; None when it does not parse (open_storage names it)."""
    with contextlib.suppress(Exception):  # any error of the parse
        from sqlalchemy.engine import make_url

        return make_url(url)
    return None


def safe_url(url: str) -> str:
    parsed = _parsed(url)
    return url if parsed is None else parsed.render_as_string(hide_password=True)


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL (None: another database, or SQLite in memory)."""
    parsed = _parsed(url)
    database = parsed and parsed.get_backend_name() == "sqlite" and parsed.database
    return None if not database or database == ":memory:" or database.startswith("file:") else Path(database).absolute()


def check_writable(study_dir: Path, url: str, option: str) -> None:
    """:class:`Refused` naming the study folder, or a SQLite database or its folder (the journal),
    when it cannot be written."""
    from graphormer_urpe.utils.files import check_creatable_dir, check_writable_dir

    try:
        (check_writable_dir if study_dir.is_dir() else check_creatable_dir)(study_dir, "the study folder")
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


def creating(url: str) -> contextlib.AbstractContextManager:
    """Workers opening a new SQLite study together take turns (``<database>.lock``), or one would
    find the other's tables half made; a server database creates them in one transaction."""
    database = sqlite_file(url)
    if database is None:
        return contextlib.nullcontext()
    try:  # acquire's proxy releases on leaving; the kernel drops the lock when the process ends
        return filelock.FileLock(f"{database}.lock").acquire()
    except OSError as exc:
        raise Refused(f"{database}.lock (the study database's lock) cannot be written "
                      f"({exc.strerror or exc})") from None


def open_storage(url: str, option: str, queue_again: bool = True):
    """The study database with Optuna's heartbeat (a busy database skips a beat): a trial whose
    beat is :data:`GRACE_S` old is failed and (``queue_again``) queued once more; :class:`Refused`."""
    import optuna
    from optuna.exceptions import StorageInternalError
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    class Storage(RDBStorage):
        def record_heartbeat(self, trial_id: int) -> None:
            with contextlib.suppress(StorageInternalError):
                super().record_heartbeat(trial_id)

    engine = {"connect_args": {"timeout": STORAGE_WAIT_S}} if sqlite_file(url) else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # heartbeats are "experimental"
        try:
            return Storage(url, engine_kwargs=engine, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                           heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1)
                           if queue_again else None)
        except Exception as exc:  # noqa: BLE001 - bad URLs, missing drivers, unreachable servers
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise Refused(f"{option} {safe_url(url)}: cannot open the study database "
                          f"({type(exc).__name__}: {first})") from None
        finally:
            optuna.logging.set_verbosity(optuna.logging.ERROR)  # the studies say how trials end


def storage_error(exc: BaseException) -> str:
    """Why the study database failed, in one line: the driver's error behind Optuna's."""
    cause = exc.__cause__ or exc
    cause = getattr(cause, "orig", None) or cause  # SQLAlchemy's wrapper: the driver's message
    return f"{type(cause).__name__}: {one_line(cause)}"


def stored_recipe(storage, name: str, recipe: dict, names: dict[str, str]) -> dict | None:
    """The recipe study ``name`` holds (None: no such study yet); :class:`Refused` when it
    differs from ``recipe`` in any of ``names`` (a recipe key: its name in words)."""
    import optuna

    if name not in optuna.get_all_study_names(storage):
        return None
    stored = optuna.load_study(study_name=name, storage=storage).user_attrs.get(RECIPE_ATTR)
    different = [names[key] for key in names if stored is not None and stored.get(key) != recipe.get(key)]
    if different:
        raise Refused(f"study {name!r} was created with another recipe (different: {', '.join(different)}): "
                      "run it with the recipe it was created with, or name a new study")
    return stored


def connect(url: str, name: str, recipe: dict, names: dict[str, str], check: Callable[[], dict],
            study_dir: Path, option: str, queue_again: bool = True, **create):
    """Study ``name`` loaded and compared with ``recipe``, or created
    (``create``: ``optuna.create_study``'s arguments) with ``recipe`` and the objective ``check()``
    gives. :class:`Refused` for a new study in a folder of another's trials or a failing database."""
    import optuna
    from optuna.exceptions import StorageInternalError

    check_writable(study_dir, url, option)
    database = sqlite_file(url)
    try:
        storage = stored = None
        if database is None or database.is_file():  # an existing database: quick to refuse
            with creating(url):
                storage = open_storage(url, option, queue_again)
                stored = stored_recipe(storage, name, recipe, names)
        recipe["objective"] = stored["objective"] if stored else check()
        study_dir.mkdir(parents=True, exist_ok=True)
        with creating(url):
            storage = storage or open_storage(url, option, queue_again)
            if stored_recipe(storage, name, recipe, names) is None:
                old = sorted(p.name for p in study_dir.glob("trial-*"))
                if old:
                    raise Refused(f"{study_dir} holds trial directories ({', '.join(old[:3])}...) but the "
                                  f"database has no study {name!r}: another study's runs; choose another "
                                  "--study or --runs-dir, or the database that holds it (--storage)")
            study = optuna.create_study(storage=storage, study_name=name, load_if_exists=True,
                                        direction="maximize" if recipe["objective"]["mode"] == "max" else "minimize",
                                        **create)
            if study.user_attrs.get(RECIPE_ATTR) is None:
                study.set_user_attr(RECIPE_ATTR, recipe)
            return study
    except StorageInternalError as exc:
        raise Refused(f"{option} {database or safe_url(url)}: the study database cannot be used "
                      f"({storage_error(exc)})") from None


def worker() -> str:
    """This worker, as a trial records it (user attribute ``worker``): ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def fail_and_queue_again(study, number: int, queue_again: bool = True) -> bool:
    """Running trial ``number`` failed and (``queue_again``) its values queued once more, as the
    heartbeat does; False when it had already finished."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    try:
        failed = study.tell(number, state=TrialState.FAIL)
    except (UpdateFinishedTrialError, ValueError):  # finished meanwhile
        return False
    if not queue_again:
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental"
        RetryHeartbeatStaleTrialCallback(max_retry=1)(study, failed)
    return True


def fail_dead_trials(study, queue_again: bool = True) -> list[int]:
    """Running trials whose worker on this machine is gone, or that recorded no worker and started
    over :data:`GRACE_S` ago, failed and queued again (:func:`fail_and_queue_again`); their numbers."""
    from optuna.trial import TrialState

    host, started = socket.gethostname(), datetime.datetime.now()

    def dead(trial) -> bool:
        worker_host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
        if not pid:
            return trial.datetime_start is not None and (started - trial.datetime_start).total_seconds() > GRACE_S
        return worker_host == host and pid.isdigit() and not _alive(int(pid))

    return [trial.number for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if dead(trial) and fail_and_queue_again(study, trial.number, queue_again)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def page_block(page: Path, begin: str, end: str, new: str | None = None) -> tuple[str, str]:
    """``(before, after)`` the block between the lines ``begin`` and ``end`` of ``page``. Without
    them it goes at the page's end (a missing page: ``new``) where ``new`` is given, else it is a
    ``ValueError``, as is a page that is not UTF-8 text."""
    try:
        with open(page, encoding="utf-8", newline="") as handle:
            text = handle.read()
    except FileNotFoundError:
        text = None
    except UnicodeDecodeError as error:
        raise ValueError(f"{page}: not UTF-8 text ({error.reason} at byte {error.start}); save it "
                         "as UTF-8") from None
    except OSError as error:
        raise ValueError(f"{page} cannot be read ({error.strerror or error})") from None
    if new is not None and (text is None or begin not in text or end not in text):
        return (new if text is None else text).rstrip("\n") + "\n\n", "\n"
    text = text or ""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{page} needs one line {begin} and, after it, one line {end} "
                         "where the table belongs")
    head, rest = text.split(begin, 1)
    return head, rest.split(end, 1)[1]


def _stamp(path: Path) -> tuple[int, int, int] | None:
    with contextlib.suppress(FileNotFoundError):
        stat = os.stat(path)
        return stat.st_ino, stat.st_size, stat.st_mtime_ns
    return None


def update_block(page: Path, begin: str, end: str, make_text: Callable[[], str], new: str | None = None) -> None:
    """The block of :func:`page_block` replaced by ``make_text()`` (run under a lock named by the
    page's real path), the rest of the page as it is then: when it changes before the rename, it is
    read and written again."""
    from graphormer_urpe.utils.files import AtomicFile, commit_together

    key = hashlib.sha256(os.path.realpath(page).encode()).hexdigest()[:16]
    with filelock.FileLock(Path(tempfile.gettempdir()) / f"graphormer-urpe-readme-{key}.lock"):
        block = make_text().strip()
        for _ in range(PAGE_TRIES):
            stamp = _stamp(page)
            head, tail = page_block(page, begin, end, new)
            with AtomicFile(page) as output:
                output.handle.write(f"{head}{begin}\n{block}\n{end}{tail}")
                if _stamp(page) == stamp:
                    commit_together([output])
                    return
        raise ValueError(f"{page} changed {PAGE_TRIES} times while its {begin[5:-4]} block was "
                         "written; it is left as it is")
