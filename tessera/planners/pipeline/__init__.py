"""Pipeline-parallel training plans: GraphPipe's graph pipelines, and the PipeDream- and Piper-style
sequential pipelines as baselines, built from one toolkit (series-parallel decomposition, per-unit
costs, the stage DP, materialization, schedules, tuning). See docs/gpp.md."""
