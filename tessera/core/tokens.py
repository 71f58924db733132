"""Training windows of a flat token file, nanoGPT's format: a ``.bin`` of uint16 ids or a 1-D
integer ``.npy``, memory-mapped (a file larger than memory trains).

Window ``i`` is tokens ``[i·S, i·S + S)`` with the next token of each as its label; every epoch visits
each window once, in an order drawn from the seed and the epoch (an affine permutation of the window
indices: no index array, whatever the file's size), and epochs follow one another. Semantics:
docs/executor.md ("Training semantics").
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from tessera.core.errors import InputError
from tessera.core.user_files import npy_header, regular_file

__all__ = ["TOKEN_SUFFIXES", "TokenWindows", "default_loss"]

TOKEN_SUFFIXES = (".bin", ".npy")


def default_loss(data: str | None) -> str:
    """The loss a run trains with unless told: a token file trains next-token prediction
    (cross-entropy), anything else squared error."""
    return "ce" if data is not None and data.endswith(TOKEN_SUFFIXES) else "mse"


_CHUNK = 1 << 24  # ids checked against the vocabulary this many at a time


class TokenWindows:
    """``batch(step, size)`` → ``(ids, labels)``, both ``[size, seq]`` int64."""

    def __init__(self, path: str, seq: int, vocab: int, seed: int = 0) -> None:
        self.path, self.seq, self.seed = path, seq, seed
        self.tokens = _open(path)
        self.windows = (len(self.tokens) - 1) // seq
        if self.windows < 1:
            raise InputError(
                f"{len(self.tokens)} tokens: a window of {seq} tokens and its next-token labels need "
                f"at least {seq + 1}",
                source=path,
            )
        for lo in range(0, len(self.tokens), _CHUNK):
            chunk = np.asarray(self.tokens[lo : lo + _CHUNK])
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= vocab:
                bad = high if high >= vocab else low
                at = lo + int(np.flatnonzero(chunk == bad)[0])
                raise InputError(
                    f"token {at} is id {bad}, outside the model's vocabulary 0..{vocab - 1}", source=path
                )

    def batch(self, step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        starts = [self._window(step * size + b) * self.seq for b in range(size)]
        rows = np.stack([np.asarray(self.tokens[s : s + self.seq + 1], dtype=np.int64) for s in starts])
        return rows[:, :-1], rows[:, 1:]

    def _window(self, k: int) -> int:
        """The window the ``k``-th sample of the run reads: epoch ``k // n``, in that epoch's order."""
        n = self.windows
        epoch, i = divmod(k, n)
        rng = np.random.default_rng([self.seed, epoch])
        a = int(rng.integers(1, max(2, n)))
        while math.gcd(a, n) != 1:  # a coprime multiplier makes i -> a·i + c a permutation
            a = a % n + 1
        return (a * i + int(rng.integers(0, n))) % n


def _open(path: str) -> np.ndarray:
    suffix = regular_file(path, what="token").suffix
    try:
        if suffix == ".npy":
            with open(path, "rb") as stream:
                npy_header(stream)  # a broken header is a ValueError here, not numpy's TokenError
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise InputError(
                    f"a token file holds one flat array of integer ids; this .npy holds {tokens.dtype} of "
                    f"shape {list(tokens.shape)}",
                    source=path,
                )
            return tokens
        size = Path(path).stat().st_size
        if size % 2:
            raise InputError(
                f"a .bin token file is uint16 ids (2 bytes each); it has {size} bytes", source=path
            )
        return np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the token file: {' '.join(str(exc).split())}", source=path) from None
