"""The error hierarchy and the exit codes every command shares.

Every error raised on purpose is a :class:`TesseraError` whose message is one line naming the file (and
the field or node) and what is wrong; the CLI prints it without a traceback. Exit codes (the README's
table; CI scripts depend on them): 0 success, 1 internal error, 2 bad input, 3 infeasible, 4 launch or
verification failure, 130 interrupted (SIGINT, Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import re
from os import PathLike

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3
EXIT_LAUNCH_FAILED = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention
EXIT_TERMINATED = 143  # 128 + SIGTERM


class TesseraError(Exception):
    """Base of every error tessera raises on purpose."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, *, source: str | PathLike[str] | None = None) -> None:
        # One line, always: a multi-line message from a library is folded.
        self.message = " ".join(str(message).split())
        self.source = None if source is None else str(source)
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """``source: message``, safe for a terminal: a file name or a value read from a file
        cannot break the line or send escape sequences (see :func:`terminal_safe`)."""
        text = f"{self.source}: {self.message}" if self.source else self.message
        return terminal_safe(text)


# C0 and C1 controls, DEL, and lone surrogates (the bytes of a file name that is not UTF-8).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def terminal_safe(text: str) -> str:
    """``text`` with every control character written as an escape (``\\n``, ``\\x1b``) and each
    undecodable file-name byte as ``\\xff``, so that a name or a string from a model file shows
    as what it is and cannot move the cursor, recolour the terminal or split a line."""

    def escape(match: re.Match[str]) -> str:
        code = ord(match.group())
        if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's stand-in for the byte code - 0xDC00
            return f"\\x{code - 0xDC00:02x}"
        return repr(match.group())[1:-1] if code < 0xD800 else f"\\u{code:04x}"

    return _UNSAFE.sub(escape, text)


class InputError(TesseraError):
    """A model, spec or plan the user gave is unreadable or invalid (exit code 2)."""

    exit_code = EXIT_BAD_INPUT


class InfeasibleError(TesseraError):
    """No plan meets the constraints (exit code 3)."""

    exit_code = EXIT_INFEASIBLE


class LaunchError(TesseraError):
    """Running or verifying a plan failed (exit code 4)."""

    exit_code = EXIT_LAUNCH_FAILED


class Terminated(Exception):  # noqa: N818 - named as the shell reports it
    """The process was asked to stop (SIGTERM): exit 143 after cleaning up, as Ctrl-C is 130."""
