"""What backends print natively while they build and run a subgraph (TVM's and OpenVINO's C++
warnings go straight to the process's stderr, hundreds of lines in a placement search): caught per
backend, told once in :func:`summary`, each line at ``-v`` as it comes (docs/placement.md).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator

log = logging.getLogger(__name__)

_STAMP = re.compile(r"^\[\d{2}:\d{2}:\d{2}\]\s*")  # TVM's "[09:00:24] " prefix
_SAID: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


@contextlib.contextmanager
def caught(backend: str) -> Iterator[None]:
    """Run the block with file descriptor 2 going to a temporary file, then keep each line written
    there as something ``backend`` said (lines with terminal escapes, a progress bar's, are
    dropped)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to catch (closed by the caller): nothing to tell either
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            for line in text.splitlines():
                line = _STAMP.sub("", line.strip())
                if line and "\x1b" not in line:
                    _SAID[backend][line] += 1
                    log.info("%s: %s", backend, line)


def summary() -> list[str]:
    """One line per backend that said something since the last call (and forget it): how many
    lines, and the most frequent."""
    lines = []
    for backend, said in sorted(_SAID.items()):
        total = sum(said.values())
        top, count = said.most_common(1)[0]
        kinds = f", {len(said)} different" if len(said) > 1 else ""
        top = top if len(top) <= 200 else top[:199] + "…"
        lines.append(
            f"{backend} printed {total} line(s){kinds} (-v shows each); most often ({count}×): {top}"
        )
    _SAID.clear()
    return lines
