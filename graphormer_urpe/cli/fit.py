"""``graphormer-urpe {fit,validate,test,predict}``: the training command (LightningCLI,
:mod:`graphormer_urpe.training.lightning_cli`), its exit statuses and its one-line errors.

What the configuration is (the data's facts linked into the model, a run's folder, resuming)
is told in :mod:`graphormer_urpe.training.lightning_cli`. ``graphormer-urpe recipes`` is answered
before Lightning is imported (seconds on a CPU), which every other subcommand needs; a ``--help``
is written by LightningCLI once and then read back (:mod:`graphormer_urpe.cli.help_cache`).
"""
from __future__ import annotations

import contextlib
import linecache
import signal
import sys
from pathlib import Path

from graphormer_urpe.cli.help_cache import asks_for_help, print_help
from graphormer_urpe.training.recipes import LIST_COMMAND, recipes_command
from graphormer_urpe.utils.process import StoppedBySignal, causes, run_command, stop_on_signals
from graphormer_urpe.utils.workers import WorkerDied

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def input_error(error: BaseException) -> Exception | None:
    """The ``ValueError`` this package raised about bad input (an option, a file), or Lightning's
    ``MisconfigurationException`` about its own options, if ``error`` is one or wraps one. jsonargparse wraps an error raised while instantiating a subclass (the
    DataModule) in its own "Does not validate against any of the Union subtypes" error; the
    cause chain leads back to ours. Other errors are bugs, not input errors: they keep their
    traceback."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    return next((cause for cause in causes(error) if isinstance(cause, ValueError) and _raised_in_package(cause)
                 or isinstance(cause, MisconfigurationException)), None)


def _raised_in_package(error: BaseException) -> bool:
    """Whether a ``raise`` statement of this package raised ``error`` (not a library call made
    from it, e.g. a numpy ``reshape``: that is a bug, which keeps its traceback)."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    return (Path(filename).resolve().is_relative_to(PACKAGE_DIR)
            and linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise "))


def stop_behind(error: BaseException) -> StoppedBySignal | None:
    """The stop (:class:`StoppedBySignal`) that ``error`` was raised while handling, if any: a
    multi-process fit stopped while its data was built fails in Lightning's barrier after it
    (the other processes were stopped by the signal too, or by this one)."""
    return next((cause for cause in causes(error) if isinstance(cause, StoppedBySignal)), None)


def stopped_while_built(stop: StoppedBySignal) -> int:
    """Say that ``stop`` ended the command while the data was built, after ending the other
    processes of a multi-process fit (they wait for the data); its exit status."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from graphormer_urpe.training.run_checkpoint import end_started_processes

    end_started_processes()
    if rank_zero_only.rank == 0:
        print(f"graphormer-urpe: stopped by {signal.Signals(stop.signum).name} while the data was built; "
              "what was half-built is removed: the same command builds it again", file=sys.stderr)
    return stop.code


def main(args: list[str] | None = None) -> int:
    """The command: exit status 0, 2 for refused input (one line naming the option or file, as
    argparse does), 1 for a diverged run, a lost worker of the data build, a lost process of a
    multi-process fit or a full disk, 128 + the signal for a fit stopped by SIGTERM, Ctrl-C or
    SIGHUP (one line from the first process of a multi-process run)."""
    command = sys.argv[1:] if args is None else list(args)
    if command[:1] == [LIST_COMMAND]:  # no Lightning needed
        return recipes_command(command[1:])
    if asks_for_help(command):  # kept once written: Lightning is imported the first time only
        from graphormer_urpe.training.recipes import command_line

        def write_help() -> None:
            from graphormer_urpe.training.lightning_cli import build_cli

            build_cli(args)  # None: the command line, as a fit reads it

        return print_help(command_line(command), write_help)
    return run_command("graphormer-urpe", lambda: _run(args), signals=False,
                       left="the checkpoints already written are whole (a fit resumes from its last.ckpt "
                            "with --ckpt_path last)")


def _run(args: list[str] | None) -> int:
    """The subcommand: the stops that a fit takes at the end of a step, or while its data is
    built, said here; Ctrl-C and a full disk left to :func:`~graphormer_urpe.utils.process.run_command`."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from graphormer_urpe.training.lightning_cli import build_cli
    from graphormer_urpe.training.run_checkpoint import lost_process, pending_stop, watch_processes

    pending_stop()  # a signal of an earlier fit in this process (built without main) is not this one's
    watch_processes()
    # The other processes of a multi-process fit wait in a barrier while the first builds the
    # data: a stop signal is taken there when they go on, as the first stops (it would fail in
    # that barrier on a process that the signal ended on the spot).
    other_process = stop_on_signals() if rank_zero_only.rank > 0 else contextlib.nullcontext()
    try:  # however it ends, the process group is closed before the interpreter exits
        with other_process:
            build_cli(args)
    except SIGTERMException:  # raised after the step in progress, which last.ckpt then holds
        return stopped(pending_stop() or signal.SIGTERM, during_training=True)
    except StoppedBySignal as stop:  # while the data was built (DataModule.prepare_data)
        return stopped_while_built(stop)
    except (FloatingPointError, WorkerDied) as exc:  # a diverged run, a data build's lost worker
        print(f"graphormer-urpe: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        stop = stop_behind(exc)
        if stop is not None:
            return stopped_while_built(stop)
        lost = lost_process()  # the collective that failed for want of it raised
        if lost is not None:
            print(f"graphormer-urpe: error: {lost}", file=sys.stderr)
            return 1
        refused = input_error(exc)
        if refused is None:
            raise
        print(f"graphormer-urpe: error: {refused}", file=sys.stderr)
        return 2
    else:
        signum = pending_stop()
        return stopped(signum, during_training=False) if signum else 0
    finally:
        end_process_group()


def end_process_group() -> None:
    """Close a multi-process run's process group: left to the interpreter's exit, gloo's threads
    can be torn down under it, and the process aborts ("terminate called") after its work is done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def stopped(signum: int, during_training: bool) -> int:
    """Say (once per run: on its first process) how a signal stopped the command; its exit status."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    if during_training:
        said = ("after the step in progress; a fit's checkpoints/last.ckpt holds that step (on every "
                "process): resume with --ckpt_path last")
    else:
        said = "after its training had ended; its checkpoints are complete"
    if rank_zero_only.rank == 0:
        print(f"graphormer-urpe: stopped by {name} {said}", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
