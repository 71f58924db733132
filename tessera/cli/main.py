"""The ``tessera`` command group and the one place where errors become exit codes.

Exit codes: 0 success, 1 internal error, 2 bad input (click usage errors too), 3 infeasible,
4 launch or verification failure (see :mod:`tessera.core.errors`).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import warnings

import click

from tessera import __version__
from tessera.api.models import TesseraWarning
from tessera.cli.backends_cmd import backends
from tessera.cli.calibrate_cmd import calibrate
from tessera.cli.inspect_cmd import inspect
from tessera.cli.launch_cmd import launch
from tessera.cli.place_cmd import place
from tessera.cli.plan import plan
from tessera.cli.render import NO_PROGRESS_ENV
from tessera.cli.validate_cmd import validate
from tessera.cli.zoo_cmd import zoo
from tessera.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    Terminated,
    TesseraError,
    terminal_safe,
)

ENVIRONMENT = {  # what a user may set; every TESSERA_ variable the package reads is here or internal
    "TESSERA_CACHE_DIR": "tessera's cache folder (profiles, TVM tuning records); default "
    "$XDG_CACHE_HOME/tessera, else ~/.cache/tessera",
    "TESSERA_NO_PROGRESS": "1: no progress bars (as --no-progress)",
    "TESSERA_DEBUG": "1: a failure with exit 1 shows its traceback, a failed worker its own; a hung worker dumps its threads' stacks",
}
INTERNAL_ENVIRONMENT = (
    "TESSERA_HEARTBEAT_DIR",
    "TESSERA_TEST_FAULT",
)  # set by launch for its workers, and tests

_EPILOG = "\b\nEnvironment:\n" + "\n".join(f"  {name}  {what}" for name, what in ENVIRONMENT.items())


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, epilog=_EPILOG
)
@click.version_option(__version__, "--version", prog_name="tessera", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
@click.option(
    "--no-progress",
    is_flag=True,
    help="No progress bars (they are off anyway when stderr is not a terminal).",
)
def cli(verbose: int, no_progress: bool) -> None:
    """tessera: place ONNX models on backends, plan parallel training and decoding, and run the plans."""
    if no_progress:
        os.environ[NO_PROGRESS_ENV] = "1"
    warnings.showwarning = _show_warning
    level = logging.WARNING - 10 * min(verbose, 2)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TerminalSafe("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


_PYTHON_SHOW_WARNING = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """The API's warnings (:class:`~tessera.api.models.TesseraWarning`) as the commands' own lines."""
    if issubclass(category, TesseraWarning):
        click.echo(terminal_safe(f"tessera: warning: {message}"), err=True)
    else:
        _PYTHON_SHOW_WARNING(message, category, filename, lineno, file, line)


class _TerminalSafe(logging.Formatter):
    """Log lines with what they quote from files (a model's dim_param, a file name) escaped: one
    line each, no escape sequences reaching the terminal (tracebacks under -vv keep their lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return terminal_safe(super().formatMessage(record))


cli.add_command(backends)
cli.add_command(calibrate)
cli.add_command(inspect)
cli.add_command(launch)
cli.add_command(place)
cli.add_command(plan)
cli.add_command(validate)
cli.add_command(zoo)


_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the group and map every failure to its documented exit code."""
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _terminate)  # unwind (temporary files removed), then exit 143
    try:
        cli.main(args=args, prog_name="tessera", standalone_mode=False)
        sys.stdout.flush()  # a full device fails here, inside the handlers below
    except TesseraError as exc:
        click.echo(f"tessera: error: {exc.one_line()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except Terminated:
        click.echo("tessera: terminated", err=True)
        sys.exit(EXIT_TERMINATED)
    except click.exceptions.Abort:
        click.echo("tessera: aborted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.exceptions.NoArgsIsHelpError as exc:
        # A bare ``tessera`` (or ``tessera zoo``): the help as click lays it out, on stderr, exit 2.
        click.echo(exc.ctx.get_help(), err=True)
        sys.exit(EXIT_BAD_INPUT)
    except click.ClickException as exc:
        # Usage errors (unknown option, missing argument, bad value): exit 2, as click does.
        message = " ".join(exc.format_message().split())
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        click.echo(f"tessera: error: {message}{hint}", err=True)
        sys.exit(exc.exit_code if exc.exit_code else EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        click.echo("tessera: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: no traceback unless asked
        _unexpected(exc, args)
    sys.exit(0)


def _out_of_memory_import(exc: Exception) -> bool:
    """A library that cannot be loaded for want of address space (``ulimit -v``)."""
    text = str(exc).lower()
    return isinstance(exc, ImportError) and (
        "failed to map segment" in text or "cannot allocate memory" in text
    )


def _unexpected(exc: Exception, args: list[str]) -> None:
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        # Files tessera writes say this themselves (InputError); what is left is standard output.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        click.echo(f"tessera: error: cannot write the output: {exc.strerror}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if os.environ.get("TESSERA_DEBUG") or "-v" in args or "--verbose" in args:
        raise exc
    if isinstance(exc, MemoryError) or _out_of_memory_import(exc):
        click.echo(
            "tessera: error: out of memory (the machine's, or a limit on this process such as ulimit -v)",
            err=True,
        )
        sys.exit(EXIT_INTERNAL)
    click.echo(
        f"tessera: internal error: {type(exc).__name__}: {terminal_safe(' '.join(str(exc).split()))} "
        "(set TESSERA_DEBUG=1 for the traceback; please report it)",
        err=True,
    )
    sys.exit(EXIT_INTERNAL)
