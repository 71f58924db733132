"""The real-export corpus as one session fixture: each export is made once (then read from the disk
cache of ``corpus.exports``), the torch modules they were made from are built on demand."""

from __future__ import annotations

import pytest
from corpus.exports import Corpus, build_corpus


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    """``corpus.entries[(model, exporter, batch)]``: the export's :class:`Entry` (path, or the
    exporter's error); ``corpus.input_shapes(key)`` and ``corpus.reference(model)`` (module, example)."""
    return build_corpus()
