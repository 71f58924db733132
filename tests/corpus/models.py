"""Third-party models for the real-export corpus: small, seeded, randomly initialised models from the
configs of transformers (GPT-2, Llama with grouped-query attention, Qwen2 with QKV bias, Phi with a
parallel residual and partial rotary, BERT, ViT, ResNet) and a
MobileNetV3-small-style CNN built from its blocks (torchvision's CPU build is not available here).
Each is wrapped to take one tensor and return one, as a user would export it."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is fetched

BATCH, SEQ, IMAGE, VOCAB = 2, 16, 32, 128
# Decoders' weights: std 0.2, not transformers' 0.02, so that greedy decoding of random weights
# picks varied tokens (at 0.02 every step picks the same one, and a decode test could not fail).
DECODER_INIT = 0.2


class _Logits(nn.Module):
    """``model(**{key: x}).<field>``: one tensor in, one out."""

    def __init__(self, model: nn.Module, key: str, field: str, **extra: object) -> None:
        super().__init__()
        self.model, self.key, self.field, self.extra = model, key, field, extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(**{self.key: x}, **self.extra), self.field)


class _DecoderLogits(nn.Module):
    """A causal LM's logits for ``input_ids`` with an all-ones attention mask. Without a mask,
    transformers 5 looks for packed sequences in the position ids (``torch.diff``, which the legacy
    exporter cannot export); a user exporting for inference passes a mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(input_ids)
        return self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits


class _PlainLogits(nn.Module):
    """``model(input_ids).logits``: the plainest export a user makes (no attention mask; transformers
    builds its causal, sliding-window or ALiBi scores inside the traced forward)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


class MaskInput(nn.Module):
    """``model(input_ids, attention_mask).logits``: the export with the mask as a second input."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


class MaskPositionInput(nn.Module):
    """``model(input_ids, attention_mask, position_ids).logits``: position ids as a third input, as
    optimum and onnxruntime-genai's exports take them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits


class CacheOutputs(nn.Module):
    """``model(input_ids)`` with its KV cache returned beside the logits (``use_cache=True``): each
    layer's keys and values as outputs, as an export for a decoding loop returns them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids=input_ids, use_cache=True)
        return (out.logits, *(t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)))


def _rescaled(model: nn.Module, std: float) -> nn.Module:
    """``model`` with every matrix but the embeddings drawn at ``std`` (seeded): the block outputs
    then outweigh the token's own embedding and greedy decoding picks varied tokens."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "emb" not in name and "wte" not in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return model


def _sinks_drawn(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build``'s model with its attention sinks' logits drawn at std 1 (seeded; transformers starts
    them at zero, where every head's would be the same)."""

    def drawn() -> nn.Module:
        model = build()
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.copy_(torch.randn(p.shape, generator=generator))
        return model

    return drawn


def _family(
    name: str,
    rescale: float | None = None,
    attention: str = "eager",
    experts: str | None = None,
    **config: object,
) -> Callable[[], nn.Module]:
    """A plain export of transformers' ``{name}ForCausalLM`` with ``config`` (2 layers); ``experts``:
    the mixture-of-experts implementation (``batched_mm`` is the one torch.export traces)."""

    def build() -> nn.Module:
        import transformers

        cls = getattr(transformers, f"{name}ForCausalLM")
        settings = {"vocab_size": VOCAB, "initializer_range": DECODER_INIT, **config}
        made = getattr(transformers, f"{name}Config")(**settings)
        if experts is not None:
            made._experts_implementation = experts
        model = cls(made)
        model.config._attn_implementation = attention
        return _PlainLogits(model if rescale is None else _rescaled(model, rescale))

    return build


_LAYERS = {"num_hidden_layers": 2, "max_position_embeddings": 64}
# Decoder families exported plainly, each with what is new in it. ``expect``: what recognition must
# report beyond what the config states in the common fields (tests/corpus/test_decoders.py).
FAMILIES: dict[str, tuple[Callable[[], nn.Module], dict[str, object]]] = {
    "qwen2-plain": (_family("Qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, **_LAYERS), {"position": "rotary", "window": None}),
    "mistral-window": (_family("Mistral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, sliding_window=4, **_LAYERS),
                       {"window": 4, "layer_windows": [4, 4]}),
    "qwen3-qknorm": (_family("Qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=128, **_LAYERS), {"head_dim": 16}),
    "gemma-mqa": (_family("Gemma", rescale=0.3, initializer_range=0.05, hidden_size=128,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256,
                          **_LAYERS), {"head_dim": 32, "kv_heads": 1}),
    "gemma2-softcap": (_family("Gemma2", rescale=0.3, initializer_range=0.02, hidden_size=64,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               intermediate_size=128, sliding_window=4, **_LAYERS),
                       {"softcap": 50.0, "layer_windows": [4, None], "window": None}),
    "bloom-alibi": (_family("Bloom", initializer_range=1.0, hidden_size=64, n_head=4, n_layer=2),
                    {"position": "alibi", "alibi": True, "qkv": "fused", "ffn": 256}),
    "falcon-mqa": (_family("Falcon", rescale=0.6, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                           multi_query=True, new_decoder_architecture=False),
                   {"kv_heads": 1, "qkv": "fused", "parallel_residual": True, "ffn": 256}),
    "neox-partial": (_family("GPTNeoX", hidden_size=64, num_attention_heads=4, intermediate_size=128,
                             rotary_pct=0.25, **_LAYERS),
                     {"rotary": {"dim": 4, "partial": True}, "qkv": "fused", "parallel_residual": True}),
    # opset 23: SDPA exports as the Attention operator (and rotary as RotaryEmbedding); Mistral's
    # window then lives in the operator's mask input.
    "qwen2-opset23": (_family("Qwen2", attention="sdpa", hidden_size=64, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, **_LAYERS), {}),
    "mistral-opset23": (_family("Mistral", attention="sdpa", hidden_size=64, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=128, sliding_window=4, **_LAYERS),
                        {"window": 4, "layer_windows": [4, 4]}),
    # Phi-3: Q|K|V in one product, gate and up in one E×2F product split in halves.
    "phi3-fused": (_family("Phi3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, pad_token_id=0, **_LAYERS),
                   {"gated_ffn": True, "qkv": "fused"}),
    "mpt-alibi": (_family("Mpt", rescale=0.6, d_model=64, n_heads=4, n_layers=2, max_seq_len=64),
                  {"position": "alibi", "alibi": True, "qkv": "fused", "ffn": 256}),
    # Mixtral: 4 experts, 2 per token, each expert's gate and up stacked E × 2F × hidden, gathered
    # per token by the router's TopK.
    "mixtral-moe": (_family("Mixtral", experts="batched_mm", hidden_size=64, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=96, num_local_experts=4,
                            num_experts_per_tok=2, **_LAYERS),
                    {"experts": 4, "experts_per_token": 2}),
    # Qwen2-MoE: 8 experts, 2 per token, and a shared expert every token also passes.
    "qwen2-moe": (_family("Qwen2Moe", experts="batched_mm", hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=48,
                          shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2, **_LAYERS),
                  {"experts": 8, "experts_per_token": 2, "shared_ffn": 96, "ffn": 48}),
    # dots.llm1: 4 experts, 2 per token, a shared expert, and its first layer a dense FFN instead
    # (first_k_dense_replace, as DeepSeek-V3 and Ernie 4.5 MoE).
    "dots1-dense": (_family("Dots1", experts="batched_mm", hidden_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128, n_routed_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=48, first_k_dense_replace=1,
                            n_shared_experts=1, **_LAYERS),
                    {"experts": 4, "experts_per_token": 2, "shared_ffn": 48, "ffn": 48, "dense_layers": 1,
                     "dense_ffn": 128}),
    # PhiMoE: its router (sparsemixer) picks 2 of 4 experts by two ArgMaxes, the second over the
    # scores with the first pick set to -inf; no TopK.
    "phimoe-argmax": (_family("Phimoe", experts="batched_mm", hidden_size=64, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=96, num_local_experts=4,
                              num_experts_per_tok=2, **_LAYERS),
                      {"experts": 4, "experts_per_token": 2}),
    # GPT-OSS: a per-head attention sink (one more logit joined to the scores, its column dropped
    # after the Softmax), a window on alternate layers, rotary tables of half the head, 4 experts.
    "gptoss-sinks": (_family("GptOss", experts="batched_mm", hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=96, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"], **_LAYERS),
                     {"experts": 4, "experts_per_token": 2, "layer_sinks": [True, True],
                      "layer_windows": [4, None], "window": None}),
    # Granite's sliding-window variant: each head's sink applied after the attention, as
    # o·sigmoid(logsumexp(scores) − sink); a window on the second layer.
    "graniteswa-sinks": (_sinks_drawn(_family("GraniteSWA", hidden_size=64, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=128, sliding_window=4,
                                              layer_types=["full_attention", "sliding_attention"], **_LAYERS)),
                         {"layer_sinks": [True, True], "layer_windows": [None, 4], "window": None}),
    # MiMo-V2-Flash: scores shifted by their maximum, a sink on its windowed layer, which holds twice
    # the KV heads of its global one; a dense FFN first, then 4 experts; rotary on a third of a head.
    "mimo-sinks": (_sinks_drawn(_family("MiMoV2Flash", experts="batched_mm", hidden_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, v_head_dim=16,
                                        intermediate_size=128, moe_intermediate_size=48, n_routed_experts=4,
                                        num_experts_per_tok=2, sliding_window=4,
                                        layer_types=["full_attention", "sliding_attention"],
                                        mlp_layer_types=["dense", "sparse"], **_LAYERS)),
                   {"kv_heads": 4, "layer_kv_heads": [2, 4], "layer_sinks": [False, True],
                    "layer_windows": [None, 4], "window": None, "experts": 4, "experts_per_token": 2,
                    "ffn": 48, "dense_layers": 1, "dense_ffn": 128, "rotary": {"dim": 6, "partial": True}}),
    # OPT: learned positions read at an offset of 2, ReLU FFN, tied head.
    "opt-learned": (_family("OPT", hidden_size=64, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64,
                            init_std=DECODER_INIT, **_LAYERS),
                    {"ffn": 128, "position": "learned", "rotary": None}),
    # GPT-J: rotary on pairs of adjacent channels (rotate every two) of the first 8 of each head,
    # attention and FFN in parallel off one norm.
    "gptj-interleaved": (_family("GPTJ", n_embd=64, n_head=4, n_layer=2, rotary_dim=8, n_positions=64),
                         {"rotary": {"dim": 8, "partial": True}, "parallel_residual": True}),
    # Exaone 4: a sliding-window layer with rotary, then a global one without ("NoPE"), norms after
    # the blocks, q/k norm.
    "exaone4-nope": (_family("Exaone4", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, sliding_window=4, pad_token_id=0,
                             layer_types=["sliding_attention", "full_attention"], **_LAYERS),
                     {"layer_windows": [4, None], "layer_rotary": [True, False], "norm": None}),
    # Persimmon: fused QKV, a LayerNormalization of each head's Q and K, rotary on half of each head.
    "persimmon-qknorm": (_family("Persimmon", hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                 pad_token_id=0, **_LAYERS),
                         {"rotary": {"dim": 8, "partial": True}, "qkv": "fused", "norm": "layernorm",
                          "gated_ffn": False}),
}  # fmt: skip


def gpt2(attention: str = "eager") -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
        attn_implementation=attention, initializer_range=DECODER_INIT,
    )  # fmt: skip
    return _DecoderLogits(transformers.GPT2LMHeadModel(config))  # LM head tied to the embedding


def llama_gqa(attention: str = "eager") -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation=attention,
        initializer_range=DECODER_INIT,
    )  # fmt: skip
    return _DecoderLogits(transformers.LlamaForCausalLM(config))


def qwen2(attention: str = "eager") -> nn.Module:
    """Grouped-query attention (8 heads, 2 KV heads) with biased Q/K/V projections, RMSNorm, SwiGLU."""
    import transformers

    config = transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation=attention,
        tie_word_embeddings=True, initializer_range=DECODER_INIT,
    )  # fmt: skip
    return _DecoderLogits(transformers.Qwen2ForCausalLM(config))


def phi(attention: str = "eager") -> nn.Module:
    """A parallel-residual block (attention and MLP both read one LayerNorm), rotary on half of each
    head (partial_rotary_factor 0.5), biased projections, GELU MLP, untied LM head with a bias."""
    import transformers

    config = transformers.PhiConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=64, partial_rotary_factor=0.5,
        attn_implementation=attention, initializer_range=DECODER_INIT,
    )  # fmt: skip
    return _DecoderLogits(transformers.PhiForCausalLM(config))


def bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=32, attn_implementation="eager",
    )  # fmt: skip
    return _Logits(transformers.BertModel(config), "input_ids", "last_hidden_state")


def vit() -> nn.Module:
    import transformers

    config = transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        image_size=IMAGE, patch_size=8, num_labels=10, attn_implementation="eager",
    )  # fmt: skip
    return _Logits(transformers.ViTForImageClassification(config), "pixel_values", "logits")


def resnet() -> nn.Module:
    import transformers

    config = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10
    )
    return _Logits(transformers.ResNetForImageClassification(config), "pixel_values", "logits")


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = nn.functional.adaptive_avg_pool2d(x, 1)
        return x * nn.functional.hardsigmoid(self.expand(torch.relu(self.reduce(scale))))


class _Bneck(nn.Module):
    """MobileNetV3's inverted residual: expand 1x1, depthwise 3x3, squeeze-excite, project 1x1."""

    def __init__(self, c_in: int, expanded: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.expand = nn.Sequential(
            nn.Conv2d(c_in, expanded, 1, bias=False), nn.BatchNorm2d(expanded), nn.Hardswish()
        )
        self.depthwise = nn.Sequential(
            nn.Conv2d(expanded, expanded, 3, stride, 1, groups=expanded, bias=False),
            nn.BatchNorm2d(expanded),
            nn.Hardswish(),
        )
        self.se = _SqueezeExcite(expanded, max(8, expanded // 4))
        self.project = nn.Sequential(nn.Conv2d(expanded, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


def mobilenet_v3_small() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(),
        _Bneck(16, 32, 16, 1), _Bneck(16, 48, 24, 2), _Bneck(24, 64, 24, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 64), nn.Hardswish(), nn.Linear(64, 10),
    )  # fmt: skip


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    input: str  # the exported input's name
    example: Callable[[], torch.Tensor]
    decoder: bool = False  # a causal LM: its dynamic exports have a dynamic sequence axis too
    plain: bool = False  # a family exported plainly: torch.export (dynamo), dynamic axes only
    opset: int = 20  # the dynamo exporter's opset


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _image() -> torch.Tensor:
    return torch.randn(BATCH, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))


MODELS: dict[str, Spec] = {
    "gpt2": Spec(gpt2, "input_ids", _ids, decoder=True),
    "gpt2-sdpa": Spec(functools.partial(gpt2, "sdpa"), "input_ids", _ids, decoder=True),
    "llama-gqa": Spec(llama_gqa, "input_ids", _ids, decoder=True),
    "llama-gqa-sdpa": Spec(functools.partial(llama_gqa, "sdpa"), "input_ids", _ids, decoder=True),
    "qwen2": Spec(qwen2, "input_ids", _ids, decoder=True),
    "phi-sdpa": Spec(functools.partial(phi, "sdpa"), "input_ids", _ids, decoder=True),
    "bert": Spec(bert, "input_ids", _ids),
    "vit": Spec(vit, "pixel_values", _image),
    "resnet": Spec(resnet, "pixel_values", _image),
    "mobilenetv3": Spec(mobilenet_v3_small, "pixel_values", _image),
    **{
        name: Spec(build, "input_ids", _ids, decoder=True, plain=True)
        for name, (build, _) in FAMILIES.items()
    },
}


def configured(model: str, config: object) -> dict[str, object]:
    """What decoder ``model`` was built with, read from its transformers ``config`` (and, for the
    families exported plainly, what is new in each: ``FAMILIES``): the fields recognition reports."""
    kind = config.model_type
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}  # transformers 5 keeps the factor here
    rotary = None if kind in ("gpt2", "bloom", "mpt", "opt") else rope.get("partial_rotary_factor", 1.0)
    want = {
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "ffn": getattr(config, "intermediate_size", None)
        or getattr(config, "n_inner", None)
        or 4 * config.hidden_size,
        "gated_ffn": kind
        in (
            "llama",
            "qwen2",
            "qwen3",
            "mistral",
            "gemma",
            "gemma2",
            "mixtral",
            "qwen2_moe",
            "exaone4",
            "dots1",
            "phimoe",
            "gpt_oss",
            "granite_swa",
            "mimo_v2_flash",
        ),
        "vocab": config.vocab_size,
        "tied_embeddings": bool(config.tie_word_embeddings),
        "rotary": None if rotary is None else {"dim": int(head_dim * rotary), "partial": rotary < 1},
        "norm": "layernorm"
        if kind in ("gpt2", "phi", "bloom", "falcon", "gpt_neox", "mpt", "opt", "gptj", "phimoe")
        else "rmsnorm",
        "parallel_residual": kind == "phi",
        "qkv": "fused" if kind == "gpt2" else "separate",
        "position": "learned" if kind == "gpt2" else "rotary",
        "window": None,
        "softcap": None,
        "alibi": False,
        "experts": 1,
        "experts_per_token": 1,
        "shared_ffn": 0,
        "dense_layers": 0,
        "dense_ffn": 0,
        "layer_sinks": [False] * config.num_hidden_layers,
    }
    return {**want, **FAMILIES.get(model, (None, {}))[1]}
