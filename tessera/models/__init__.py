"""The model zoo: deterministic builders of the benchmark models of the references, as ONNX.

:func:`build` (name, size, seed, config overrides) gives byte-identical output for the same arguments;
each model has a ``tiny`` size for tests and the ``paper`` size of its source. Paper-size models are lazy
(:mod:`tessera.core.weights`: shapes only); :func:`materialize` fills in the weights. Conventions: opset
17, IR version 8, fp32, symbolic first dimension ``batch``, unique scoped node names, the config in
``metadata_props`` as ``tessera.<field>``. Details: docs/models.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import onnx

from tessera.core.errors import InputError
from tessera.core.weights import LAZY_LOCATION, is_lazy, materialize
from tessera.models import bert, candle_uno, dlrm, gpt, mmt, resnext

__all__ = ["LAZY_LOCATION", "SIZES", "ZOO", "ModelSpec", "build", "is_lazy", "materialize", "parameter_count"]

SIZES = ("tiny", "paper")


@dataclass(frozen=True)
class ModelSpec:
    """A zoo entry: what the model is, its configs by size, and its builder."""

    name: str
    description: str
    configs: Mapping[str, Any]
    builder: Callable[..., onnx.ModelProto]

    @property
    def sizes(self) -> tuple[str, ...]:
        return tuple(self.configs)


ZOO: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "mmt",
            "multi-modal transformer: parallel transformer branches concatenated, then a classifier "
            "(GraphPipe A.2; paper: 4 branches x 8 layers, seq 256, hidden 1024, 16 heads, FFN 4096)",
            mmt.CONFIGS,
            mmt.build_mmt,
        ),
        ModelSpec(
            "dlrm",
            "recommendation model: 7 dense MLP branches + 7 embedding-bag branches, concat, top MLP "
            "(GraphPipe A.2; paper: width 4096, 1M x 64 tables, bag 100)",
            dlrm.CONFIGS,
            dlrm.build_dlrm,
        ),
        ModelSpec(
            "candle_uno",
            "drug-response model: 7 branches of 4 feed-forward layers, concat, top MLP "
            "(GraphPipe A.2; paper: width 4096)",
            candle_uno.CONFIGS,
            candle_uno.build_candle_uno,
        ),
        ModelSpec(
            "resnext",
            "CNN of grouped-convolution bottleneck blocks (paper: ResNeXt-50 32x4d, 224x224)",
            resnext.CONFIGS,
            resnext.build_resnext,
        ),
        ModelSpec(
            "bert",
            "BERT-style post-norm encoder (paper: BERT-base, 12 layers, 768, 12 heads, seq 128)",
            bert.CONFIGS,
            bert.build_bert,
        ),
        ModelSpec(
            "gpt",
            "GPT-2-style decoder-only transformer, causal, optional grouped-query attention "
            "(paper: GPT-2 small, 12 layers, 768, 12 heads, seq 1024, vocab 50257)",
            gpt.CONFIGS,
            gpt.build_gpt,
        ),
    )
}


def build(
    name: str, size: str = "tiny", seed: int = 0, *, lazy: bool | None = None, **overrides: Any
) -> onnx.ModelProto:
    """Build zoo model ``name`` at ``size`` with weights drawn from ``seed``.

    ``lazy`` (default: only for ``paper``) leaves the weights to :func:`materialize`.
    ``overrides`` replace fields of the size's config, e.g. ``build("gpt", kv_heads=2)``.
    Raises :class:`InputError` for an unknown name, size or config field, or a negative seed.
    """
    spec = ZOO.get(name)
    if spec is None:
        raise InputError(f"unknown model {name!r}; the zoo has: {', '.join(ZOO)}")
    if size not in spec.configs:
        raise InputError(f"model {name!r} has no size {size!r}; sizes: {', '.join(spec.sizes)}")
    if seed < 0:
        raise InputError(f"seed must be a non-negative integer, got {seed}")
    config = spec.configs[size]
    if overrides:
        fields = [f.name for f in dataclasses.fields(config)]
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise InputError(
                f"model {name!r} has no config field {', '.join(unknown)}; fields: {', '.join(fields)}"
            )
        config = dataclasses.replace(config, **overrides)
    try:
        model = spec.builder(config, seed=seed, lazy=size == "paper" if lazy is None else lazy)
    except ValueError as error:  # an inconsistent override, e.g. kv_heads not dividing heads
        raise InputError(f"model {name!r}: {error}") from error
    model.metadata_props.add(key="tessera.size", value=size)
    return model


def parameter_count(model: onnx.ModelProto) -> int:
    """The parameter count a zoo model records (``tessera.parameters``), for lazy and eager models."""
    for prop in model.metadata_props:
        if prop.key == "tessera.parameters":
            return int(prop.value)
    raise InputError(f"model {model.graph.name!r} was not built by the zoo (no tessera.parameters)")
