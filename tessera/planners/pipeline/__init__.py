"""Graph pipeline parallelism (GraphPipe): series-parallel decomposition, partitioner, schedules,
memory model, plan checks, and the ``tessera plan --kind gpp`` entry point."""

from tessera.planners.pipeline import checks as checks  # registers the C1–C5 + memory plan check
