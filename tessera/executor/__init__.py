"""Interprets plans: :data:`RUNNERS` runs each plan kind and returns one kind of report.

See docs/executor.md for how each kind runs.
"""

from tessera.executor.report import RunReport
from tessera.executor.runners import RUNNERS, LaunchRequest

__all__ = ["RUNNERS", "LaunchRequest", "RunReport"]
