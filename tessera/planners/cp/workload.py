"""The decode workload a CP plan serves: batch size, prompt (context) length, output lengths.

Output lengths are a distribution (``N``, ``uniform:A-B``, ``file:PATH``) because nobody knows them in
advance, which is what makes DP straggle. Token counts take ``K``/``M`` suffixes and lie in
``1..MAX_TOKENS``, ``--batch`` in ``1..MAX_BATCH``; anything else is an :class:`InputError` (exit code 2).

References: thesis §4.1, §4.3. Details: docs/cp.md.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tessera.core.errors import InputError
from tessera.core.plans import MAX_BATCH, MAX_CONTEXT
from tessera.core.user_files import MAX_TEXT_BYTES, read_user_file

__all__ = [
    "MAX_BATCH",
    "MAX_TOKENS",
    "OutputLengths",
    "Workload",
    "dp_replica_steps",
    "parse_output_lengths",
    "parse_token_count",
    "parse_token_counts",
]

_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_SCALE = {"": 1, "k": 1024, "m": 1024 * 1024}

MAX_TOKENS = MAX_CONTEXT
"""The largest token count (context, output length) accepted: 1024M, beyond any model's positions
(the plan schema's bound on a cp plan's context, :data:`tessera.core.plans.MAX_CONTEXT`)."""
# MAX_BATCH: the largest ``--batch`` accepted, 65536 (the DP Monte Carlo holds trials × batch output
# lengths); a cp plan's bound (tessera.core.plans, where the schema reads it).
_TOKEN_RANGE = f"1..{MAX_TOKENS} (1024M)"


def _shown(text: object, limit: int = 32) -> str:
    """``repr(text)``, cut short: a value with thousands of digits must not flood the one-line error."""
    text = str(text)
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"… ({len(text)} characters)"


def parse_token_count(text: str | int, *, option: str = "value") -> int:
    """``"32K"`` → 32768, ``"1M"`` → 1048576, ``"1000"`` → 1000. Raises :class:`InputError`."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _COUNT.match(str(text))
        if match is None:
            raise InputError(
                f"{option}: expected a token count such as 4096, 32K or 1M (K = 1024); got {_shown(text)}"
            )
        number = float(match[1]) * _SCALE[match[2].lower()]
        if not math.isfinite(number) or number > MAX_TOKENS:
            raise InputError(f"{option}: token counts must be in {_TOKEN_RANGE}; got {_shown(text)}")
        if number != int(number):
            raise InputError(f"{option}: {_shown(text)} is not a whole number of tokens")
        value = int(number)
    if value < 1:
        raise InputError(f"{option}: must be at least 1 token; got {text!r}")
    if value > MAX_TOKENS:
        raise InputError(f"{option}: token counts must be in {_TOKEN_RANGE}; got {_shown(text)}")
    return value


def parse_token_counts(text: str, *, option: str = "value") -> list[int]:
    """A comma-separated list of token counts (``1K,10K,100K``), in the order given, without repeats."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise InputError(f"{option}: expected a comma-separated list such as 1K,10K,100K; got {text!r}")
    return list(dict.fromkeys(parse_token_count(p, option=option) for p in parts))


@dataclass(frozen=True)
class OutputLengths:
    """A distribution of output (generated) lengths; see the module docstring for the forms."""

    kind: Literal["fixed", "uniform", "file"]
    low: int
    high: int
    samples: tuple[int, ...] = ()
    path: str | None = None
    sha256: str | None = None

    @property
    def spec(self) -> str:
        """The form it was given in (``256``, ``uniform:1-1024``, ``file:PATH``)."""
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"uniform:{self.low}-{self.high}"
        return f"file:{self.path}"

    @property
    def max(self) -> int:
        return self.high

    @property
    def mean(self) -> float:
        if self.kind == "file":
            return float(np.mean(self.samples))
        return (self.low + self.high) / 2

    @property
    def mean_square(self) -> float:
        if self.kind == "file":
            return float(np.mean(np.square(np.asarray(self.samples, dtype=np.float64))))
        if self.kind == "fixed":
            return float(self.low) ** 2
        # Closed form (exact integers, one rounding): Σ n² over low..high, divided by the count.
        return (_sum_of_squares(self.high) - _sum_of_squares(self.low - 1)) / (self.high - self.low + 1)

    @property
    def mean_kv_growth(self) -> float:
        """Mean number of generated tokens in a request's KV cache over the decode steps.

        A request generating ``o`` tokens spends ``o`` steps with ``0..o-1`` of them cached; weighting
        requests by the steps they occupy (length-biased) gives ``(E[o²]/E[o] - 1) / 2``.
        """
        return max(0.0, (self.mean_square / self.mean - 1) / 2)

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(shape, self.low, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=shape, dtype=np.int64)
        return rng.choice(np.asarray(self.samples, dtype=np.int64), size=shape, replace=True)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"spec": self.spec, "kind": self.kind, "min": self.low, "max": self.high}
        data["mean"] = round(self.mean, 3)
        if self.kind == "file":
            data.update(samples=len(self.samples), sha256=self.sha256)
        return data


def _sum_of_squares(n: int) -> int:
    """``1² + 2² + … + n²``."""
    return n * (n + 1) * (2 * n + 1) // 6


def parse_output_lengths(text: str | int, *, option: str = "--output-len") -> OutputLengths:
    """Parse ``N``, ``uniform:A-B`` or ``file:PATH``. Raises :class:`InputError` naming ``option``."""
    spec = str(text).strip()
    if spec.startswith("uniform:"):
        match = re.match(r"^uniform:\s*(\S+?)\s*-\s*(\S+)$", spec)
        if match is None:
            raise InputError(f"{option}: expected uniform:A-B such as uniform:1-1024; got {spec!r}")
        low = parse_token_count(match[1], option=option)
        high = parse_token_count(match[2], option=option)
        if low > high:
            raise InputError(f"{option}: uniform:A-B needs A <= B; got {spec!r}")
        return OutputLengths("uniform", low, high)
    if spec.startswith("file:"):
        path = Path(spec[len("file:") :])
        raw = read_user_file(path, what=f"{option} lengths", limit=MAX_TEXT_BYTES)
        try:
            lines = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise InputError(f"{option}: the output lengths are not UTF-8 text", source=path) from None
        samples: list[int] = []
        for number, line in enumerate(lines, start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            digits = line.lstrip("0")  # int() of a huge string is slow or refused: check the length first
            if not (line.isascii() and line.isdigit()) or not digits:
                raise InputError(
                    f"{option}: line {number}: expected a positive integer (tokens); got {_shown(line)}",
                    source=path,
                )
            if len(digits) > len(str(MAX_TOKENS)) or int(digits) > MAX_TOKENS:
                raise InputError(
                    f"{option}: line {number}: output lengths must be in {_TOKEN_RANGE}; got {_shown(line)}",
                    source=path,
                )
            samples.append(int(digits))
        if not samples:
            raise InputError(f"{option}: no output lengths in the file", source=path)
        return OutputLengths(
            "file",
            min(samples),
            max(samples),
            tuple(samples),
            path=str(path),
            sha256=hashlib.sha256(raw).hexdigest(),
        )
    body = spec.removeprefix("fixed:")
    if not _COUNT.match(body):
        raise InputError(f"{option}: expected N, uniform:A-B or file:PATH; got {spec!r}")
    value = parse_token_count(body, option=option)
    return OutputLengths("fixed", value, value)


@dataclass(frozen=True)
class Workload:
    """``batch`` concurrent requests (the continuous-batching limit), each with a prompt of
    ``context`` tokens whose KV cache is already filled, then generating ``output`` tokens."""

    batch: int
    context: int
    output: OutputLengths = field(default_factory=lambda: OutputLengths("uniform", 1, 1024))

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= MAX_BATCH:
            raise InputError(f"--batch: must be in 1..{MAX_BATCH} (concurrent requests); got {self.batch}")
        if not 1 <= self.context <= MAX_TOKENS:
            raise InputError(f"--context: must be in {_TOKEN_RANGE} tokens; got {self.context}")

    @property
    def mean_kv_length(self) -> float:
        """KV positions a decode step attends to, averaged over the steps: prompt plus growth."""
        return self.context + self.output.mean_kv_growth

    @property
    def max_kv_length(self) -> int:
        """KV positions a request holds at its last step: what memory must fit."""
        return self.context + self.output.max

    def with_context(self, context: int) -> Workload:
        return Workload(self.batch, context, self.output)

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "context": self.context,
            "output_len": self.output.to_json(),
            "mean_kv_length": round(self.mean_kv_length, 3),
            "max_kv_length": self.max_kv_length,
        }


@functools.lru_cache(maxsize=256)
def _replica_steps(output: OutputLengths, batch: int, replicas: int, trials: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = output.sample(rng, (trials, batch))  # int64; batch <= MAX_BATCH keeps it bounded
    # Round-robin (lengths are unknown when requests are placed): replica r owns requests r, r+N, …
    # Integer sums over strided views: exact, and no float copy of the whole array.
    counts = np.bincount(np.arange(batch) % replicas, minlength=replicas).astype(np.float64)
    work = np.zeros((trials, replicas))
    for r in range(replicas):
        work[:, r] = lengths[:, r::replicas].sum(axis=1)
    steps = work / counts
    steps.setflags(write=False)
    return steps


def dp_replica_steps(
    output: OutputLengths, batch: int, replicas: int, *, trials: int = 2048, seed: int = 0
) -> np.ndarray:
    """Decode steps each DP replica needs, ``[trials, replicas]``, by seeded Monte Carlo.

    ``batch`` requests are dealt round-robin to the replicas (their output lengths are unknown when
    they are placed, thesis §4.3) and each replica serves its requests with continuous batching in
    its ``batch / replicas`` slots, so it needs ``Σ output lengths / slots`` steps. The job takes
    the maximum over replicas; a balanced strategy (TP, CP) takes the mean. Deterministic for a seed.
    """
    if replicas < 1 or batch < replicas:
        raise ValueError(f"need 1 <= replicas <= batch; got {replicas} replicas for batch {batch}")
    return _replica_steps(output, batch, replicas, trials, seed)
