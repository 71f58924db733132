"""Cache-parallel (CP) decode planning: thesis-jeon chapter 4 (cache parallelism, §4.4–4.5).

- :mod:`~tessera.planners.cp.llm`: the decoder's shape (:class:`LlmConfig`), from YAML or a preset;
- :mod:`~tessera.planners.cp.recognize`: the same, recognized in an ONNX graph by structure;
- :mod:`~tessera.planners.cp.workload`: batch, context and output-length distribution;
- :mod:`~tessera.planners.cp.cost`: the per-decode-step cost of CP, TP and DP (thesis §4.4 formulas);
- :mod:`~tessera.planners.cp.plan`: :func:`plan_cp` and the context sweep;
- :mod:`~tessera.planners.cp.plot`: the sweep as an SVG.
"""

from tessera.planners.cp.cost import (
    CostParams,
    Estimate,
    cp_comm_elements,
    estimate,
    estimate_all,
    tp_comm_elements,
)
from tessera.planners.cp.llm import LlmConfig, LlmSource, load_llm_config
from tessera.planners.cp.plan import SweepRow, plan_cp, sweep_context
from tessera.planners.cp.recognize import recognize_llm
from tessera.planners.cp.workload import OutputLengths, Workload, parse_output_lengths, parse_token_count

__all__ = [
    "CostParams",
    "Estimate",
    "LlmConfig",
    "LlmSource",
    "OutputLengths",
    "SweepRow",
    "Workload",
    "cp_comm_elements",
    "estimate",
    "estimate_all",
    "load_llm_config",
    "parse_output_lengths",
    "parse_token_count",
    "plan_cp",
    "recognize_llm",
    "sweep_context",
    "tp_comm_elements",
]
