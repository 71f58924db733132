"""The decoder-only LLM a cache-parallel plan is for: its shape (layers, E, H, …) and where it came from.

A :class:`LlmConfig` carries what the CP cost model needs (the KV cache per token and layer is
``2 · kv_heads · head_dim`` elements). It comes from an ONNX model
(:func:`tessera.planners.cp.recognize.recognize_llm`), a YAML file (``--llm my-model.yaml``, validated,
one-line errors) or a preset in ``configs/llm/`` (``--llm llama-7b``).

References: thesis §4.4. Example file: docs/cp.md.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Private helpers of the cluster-spec reader: the same strict YAML and the same one-line messages.
from tessera.core import config_files
from tessera.core.errors import InputError
from tessera.core.plans import LLM_SIZE_LIMITS

__all__ = [
    "DTYPE_BYTES",
    "LlmConfig",
    "LlmSource",
    "list_llm_presets",
    "llm_presets_dir",
    "load_llm_config",
]

# Bytes per element of the data types a decoder may be served in.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


class LlmConfig(config_files.ConfigModel):
    """A decoder-only transformer's shape: what the CP/TP/DP cost model reads.

    ``kv_heads`` defaults to ``heads`` (multi-head attention; fewer is grouped-query attention) and
    ``head_dim`` to ``hidden / heads``. ``gated_ffn`` counts three FFN matrices (gate, up, down:
    SwiGLU, as in Llama) instead of two (fc1, fc2: GELU, as in GPT-2). A mixture-of-experts FFN has
    ``experts`` FFNs of width ``ffn`` and a router sending each token to ``experts_per_token`` of them
    (Mixtral: 8, 2); the default, one expert, is a dense FFN. ``shared_ffn``: the width of a dense FFN
    every token also goes through beside its experts (Qwen2-MoE's shared expert), 0 for none.
    ``dense_layers`` of a mixture's layers have a dense FFN of width ``dense_ffn`` instead (DeepSeek's,
    Ernie 4.5's and dots.llm1's first layers, Llama 4's every other one); which ones does not change
    a step's cost, so the count is kept.
    """

    # Sizes within what a cp plan may hold (LLM_SIZE_LIMITS: beyond any published model).
    name: str = Field(min_length=1)
    layers: int = Field(strict=True, ge=1, le=LLM_SIZE_LIMITS["layers"])
    hidden: int = Field(strict=True, ge=1, le=LLM_SIZE_LIMITS["hidden"])
    heads: int = Field(strict=True, ge=1, le=LLM_SIZE_LIMITS["heads"])
    kv_heads: int | None = Field(default=None, strict=True, ge=1, le=LLM_SIZE_LIMITS["kv_heads"])
    head_dim: int | None = Field(default=None, strict=True, ge=1, le=LLM_SIZE_LIMITS["head_dim"])
    ffn: int = Field(strict=True, ge=1, le=LLM_SIZE_LIMITS["ffn"])
    vocab: int = Field(strict=True, ge=1, le=LLM_SIZE_LIMITS["vocab"])
    dtype: Literal["fp32", "fp16", "bf16", "fp8", "int8"] = "fp16"
    gated_ffn: bool = False
    tied_embeddings: bool = False
    experts: int = Field(default=1, strict=True, ge=1, le=LLM_SIZE_LIMITS["experts"])
    experts_per_token: int = Field(default=1, strict=True, ge=1, le=LLM_SIZE_LIMITS["experts_per_token"])
    shared_ffn: int = Field(default=0, strict=True, ge=0, le=LLM_SIZE_LIMITS["ffn"])
    dense_layers: int = Field(default=0, strict=True, ge=0, le=LLM_SIZE_LIMITS["layers"])
    dense_ffn: int = Field(default=0, strict=True, ge=0, le=LLM_SIZE_LIMITS["ffn"])

    @model_validator(mode="after")
    def _defaults_and_consistency(self) -> LlmConfig:
        kv_heads = self.heads if self.kv_heads is None else self.kv_heads
        if self.heads % kv_heads:
            raise ValueError(f"kv_heads: {kv_heads} must divide heads ({self.heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"head_dim: required, heads ({self.heads}) does not divide hidden ({self.hidden})"
            )
        if self.experts_per_token > self.experts:
            raise ValueError(
                f"experts_per_token: {self.experts_per_token} is more than the {self.experts} experts"
            )
        if self.dense_layers and (
            self.experts == 1 or self.dense_layers >= self.layers or not self.dense_ffn
        ):
            raise ValueError(
                f"dense_layers: {self.dense_layers} dense FFN layers need a mixture of experts in the others "
                f"(experts > 1, fewer than {self.layers} layers) and their width dense_ffn"
            )
        head_dim = self.hidden // self.heads if self.head_dim is None else self.head_dim
        object.__setattr__(self, "kv_heads", kv_heads)
        object.__setattr__(self, "head_dim", head_dim)
        return self

    # -- derived sizes (elements unless named bytes) ------------------------------------------------

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V) per token: ``kv_heads · head_dim`` (= E for multi-head attention)."""
        return int(self.kv_heads) * int(self.head_dim)  # type: ignore[arg-type]

    @property
    def q_dim(self) -> int:
        """Width of Q and of the attention output per token: ``heads · head_dim`` (= E usually)."""
        return self.heads * int(self.head_dim)  # type: ignore[arg-type]

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projection weights of one layer."""
        return self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + self.q_dim * self.hidden

    @property
    def expert_params(self) -> int:
        """Weights of one FFN (of one expert in a mixture of experts)."""
        return (3 if self.gated_ffn else 2) * self.hidden * self.ffn

    @property
    def every_token_params(self) -> int:
        """What every token reads beside its experts: the router's hidden × experts projection and
        a shared expert (none for a dense FFN)."""
        if self.experts == 1:
            return 0
        return self.hidden * self.experts + (3 if self.gated_ffn else 2) * self.hidden * self.shared_ffn

    def _per_layer(self, moe: float) -> float:
        """An FFN quantity per layer: ``moe``'s in every layer, or with ``dense_layers`` the mean over
        the layers of ``moe`` and a dense FFN's weights."""
        if not self.dense_layers:
            return moe
        dense = (3 if self.gated_ffn else 2) * self.hidden * self.dense_ffn
        return ((self.layers - self.dense_layers) * moe + self.dense_layers * dense) / self.layers

    @property
    def ffn_params(self) -> float:
        """Weights of one layer's FFN as held: every expert and the router (mean over the layers)."""
        return self._per_layer(self.experts * self.expert_params + self.every_token_params)

    @property
    def active_ffn_params(self) -> float:
        """Weights one token multiplies by: its ``experts_per_token`` experts and the router."""
        return self._per_layer(self.experts_per_token * self.expert_params + self.every_token_params)

    def experts_read(self, tokens: int) -> float:
        """The experts at least one of ``tokens`` tokens is routed to, in expectation over uniform
        routing: E·(1 − (1 − k/E)^tokens) (1 for a dense FFN)."""
        untouched = (1 - self.experts_per_token / self.experts) ** max(tokens, 1)
        return self.experts * (1 - untouched) if self.experts > 1 else 1.0

    def ffn_read_params(self, tokens: int) -> float:
        """FFN weights a step of ``tokens`` tokens reads: the experts it reaches
        (:meth:`experts_read`) and what every token reads (the router, a shared expert)."""
        return self._per_layer(self.experts_read(tokens) * self.expert_params + self.every_token_params)

    @property
    def layer_params(self) -> float:
        """Weights of one transformer layer: projections, FFN and two norms (scale + bias)."""
        return self.attention_params + self.ffn_params + 4 * self.hidden

    def layer_read_params(self, tokens: int) -> float:
        """Weights of one layer a decode step of ``tokens`` tokens reads (:meth:`ffn_read_params`)."""
        return self.attention_params + self.ffn_read_params(tokens) + 4 * self.hidden

    @property
    def embedding_params(self) -> int:
        """Token embedding plus LM head (one matrix when tied)."""
        return (1 if self.tied_embeddings else 2) * self.vocab * self.hidden

    @property
    def params(self) -> int:
        return round(self.layers * self.layer_params) + self.embedding_params

    def kv_bytes_per_token(self, layers: int | None = None) -> int:
        """KV-cache bytes one token adds over ``layers`` layers (default all): ``2 · kv_dim · bytes``."""
        return (self.layers if layers is None else layers) * 2 * self.kv_dim * self.dtype_bytes

    def with_dtype(self, dtype: str | None) -> LlmConfig:
        return self if dtype is None or dtype == self.dtype else self.model_copy(update={"dtype": dtype})

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "ffn": self.ffn,
            "vocab": self.vocab,
            "dtype": self.dtype,
            "gated_ffn": self.gated_ffn,
            "tied_embeddings": self.tied_embeddings,
            "experts": self.experts,
            "experts_per_token": self.experts_per_token,
            "shared_ffn": self.shared_ffn,
            **({"dense_layers": self.dense_layers, "dense_ffn": self.dense_ffn} if self.dense_layers else {}),
            "parameters": self.params,
        }


class LlmSource(BaseModel):
    """Where an :class:`LlmConfig` came from: ``onnx`` (recognized), ``file`` or ``preset``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["onnx", "file", "preset"]
    path: str
    sha256: str


def llm_presets_dir() -> Path:
    """The folder of LLM presets (``configs/llm``)."""
    return config_files.presets_dir("llm")


def list_llm_presets() -> list[str]:
    return config_files.list_presets("llm")


def load_llm_config(path_or_preset: str | Path) -> tuple[LlmConfig, LlmSource]:
    """Read ``--llm``: a YAML file or a preset name. Raises :class:`InputError` (one line) on any problem."""
    path, kind = config_files.resolve_config(path_or_preset, kind="llm", what="LLM config")
    data, raw = config_files.read_yaml(path, what="LLM config")
    config = parse_llm_config(data, source=str(path))
    label = str(path_or_preset) if kind == "preset" else str(path)
    return config, LlmSource(kind=kind, path=label, sha256=hashlib.sha256(raw).hexdigest())


def parse_llm_config(data: Any, *, source: str | None = None) -> LlmConfig:
    """Validate already-loaded data as an :class:`LlmConfig` (one-line errors naming ``source``)."""
    if not isinstance(data, dict):
        got = "an empty document" if data is None else f"a YAML {type(data).__name__}"
        raise InputError(
            f"expected an LLM config mapping (name, layers, hidden, heads, ffn, vocab, …); got {got}",
            source=source,
        )
    try:
        return LlmConfig.model_validate(data)
    except ValidationError as err:
        raise InputError(config_files.format_validation_error(err), source=source) from None
