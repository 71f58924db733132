"""A decoder written as onnxruntime-genai's model builder writes one: ``com.microsoft``
``GroupQueryAttention`` per layer (rotary inside it, from cos/sin caches), its own KV cache as graph
inputs (``past_key_values.N.key``) and outputs (``present.N.key``), ``seqlens_k`` and
``total_sequence_length`` computed from the attention mask, ``SimplifiedLayerNormalization``.
Random weights; the builder's form, not its code."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD, FFN, LAYERS, MAX_POS = 128, 64, 4, 2, 16, 96, 2, 256


def gqa_decoder(
    *,
    seed: int = 0,
    window: int = -1,
    softcap: float = 0.0,
    interleaved: bool = False,
    packed: bool = False,
    head: int = HEAD,
    rotary_dim: int | None = None,
) -> onnx.ModelProto:
    """The decoder; ``head`` wide heads, the first ``rotary_dim`` of each turned (all by default)."""
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def weight(name: str, *shape: int, std: float = 0.3) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * std).astype(np.float32), name))
        return name

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def node(op: str, inputs: list[str], out: str, domain: str = "", **attrs: object) -> str:
        nodes.append(helper.make_node(op, inputs, [out], name=f"/{out}", domain=domain, **attrs))
        return out

    turned = rotary_dim or head
    inv = 1.0 / (10000 ** (np.arange(0, turned, 2) / turned))
    angles = np.outer(np.arange(MAX_POS), inv)
    const("cos_cache", np.cos(angles).astype(np.float32))
    const("sin_cache", np.sin(angles).astype(np.float32))
    const("one", np.array([1], np.int64))
    const("axis1", np.array([1], np.int64))
    const("idx1", np.array(1, np.int64))
    summed = node("ReduceSum", ["attention_mask", "axis1"], "mask_sum", keepdims=0)
    node("Cast", [node("Sub", [summed, "one"], "seqlens_k_64")], "seqlens_k", to=TensorProto.INT32)
    total = node("Gather", [node("Shape", ["attention_mask"], "mask_shape"), "idx1"], "total_64", axis=0)
    node("Cast", [total], "total_sequence_length", to=TensorProto.INT32)

    def rms(x: str, name: str) -> str:
        gamma = const(f"{name}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        return node("SimplifiedLayerNormalization", [x, gamma], f"{name}/out", axis=-1, epsilon=1e-5)

    h = node("Gather", [weight("embed", VOCAB, HIDDEN, std=1.0), "input_ids"], "embedded")
    outputs = []
    for i in range(LAYERS):
        x = rms(h, f"l{i}/input_norm")
        q_w, kv_w = HEADS * head, KV_HEADS * head
        if packed:
            qkv = node("MatMul", [x, weight(f"l{i}.qkv", HIDDEN, q_w + 2 * kv_w)], f"l{i}/qkv")
            qkv_inputs = [qkv, "", ""]
        else:
            qkv_inputs = [node("MatMul", [x, weight(f"l{i}.{p}", HIDDEN, w)], f"l{i}/{p}")
                          for p, w in (("q", q_w), ("k", kv_w), ("v", kv_w))]  # fmt: skip
        attrs: dict[str, object] = {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "do_rotary": 1}
        attrs |= {"local_window_size": window} if window > 0 else {}
        attrs |= {"softcap": softcap} if softcap else {}
        attrs |= {"rotary_interleaved": 1} if interleaved else {}
        present = [f"present.{i}.key", f"present.{i}.value"]
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [
                    *qkv_inputs,
                    f"past_key_values.{i}.key",
                    f"past_key_values.{i}.value",
                    "seqlens_k",
                    "total_sequence_length",
                    "cos_cache",
                    "sin_cache",
                ],
                [f"l{i}/attn", *present],
                name=f"/l{i}/GroupQueryAttention",
                domain="com.microsoft",
                **attrs,
            )  # fmt: skip
        )
        outputs += present
        o = node("MatMul", [f"l{i}/attn", weight(f"l{i}.o", q_w, HIDDEN)], f"l{i}/o")
        h = node("Add", [h, o], f"l{i}/resid1")
        y = rms(h, f"l{i}/post_norm")
        gate = node("MatMul", [y, weight(f"l{i}.gate", HIDDEN, FFN)], f"l{i}/gate")
        up = node("MatMul", [y, weight(f"l{i}.up", HIDDEN, FFN)], f"l{i}/up")
        act = node("Mul", [gate, node("Sigmoid", [gate], f"l{i}/sig")], f"l{i}/silu")
        down = node(
            "MatMul", [node("Mul", [act, up], f"l{i}/gated"), weight(f"l{i}.down", FFN, HIDDEN)], f"l{i}/down"
        )
        h = node("Add", [h, down], f"l{i}/resid2")
    node("MatMul", [rms(h, "final_norm"), weight("lm_head", HIDDEN, VOCAB)], "logits")
    cache = ["batch_size", KV_HEADS, "past_sequence_length", head]
    present_shape = ["batch_size", KV_HEADS, "total_sequence_length", head]
    graph = helper.make_graph(
        nodes, "gqa-decoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
         *(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", TensorProto.FLOAT, cache)
           for i in range(LAYERS) for kv in ("key", "value"))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", VOCAB]),
         *(helper.make_tensor_value_info(name, TensorProto.FLOAT, present_shape) for name in outputs)],
        inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def empty_cache(session: ort.InferenceSession, batch: int) -> dict[str, np.ndarray]:
    """A past of length 0 for each of the session's cache inputs."""
    return {
        i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32)
        for i in session.get_inputs()
        if i.name.startswith("past")
    }


def run_whole(session: ort.InferenceSession, ids: np.ndarray) -> np.ndarray:
    """The graph's logits for ``ids`` ``[B, S]`` with an empty cache, as onnxruntime computes them."""
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), **empty_cache(session, ids.shape[0])}
    return session.run(["logits"], feeds)[0]


def cached_greedy(model: onnx.ModelProto, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens per prompt, decoded by onnxruntime with the graph's own cache (the prompt
    in one pass, then a token per pass, each ``present`` fed back as the next ``past``)."""
    session = ort.InferenceSession(model.SerializeToString())
    out = []
    for prompt in prompts:
        ids = np.array([prompt], np.int64)
        past, total, tokens = empty_cache(session, 1), len(prompt), []
        for _ in range(n):
            feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), **past}
            logits, *present = session.run(None, feeds)
            tokens.append(int(logits[0, -1].argmax()))
            names = [o.name for o in session.get_outputs()][1:]
            past = {
                name.replace("present", "past_key_values"): t for name, t in zip(names, present, strict=True)
            }
            ids, total = np.array([[tokens[-1]]], np.int64), total + 1
        out.append(tokens)
    return out


def whole_greedy(model: onnx.ModelProto, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The same tokens computed without a cache: the whole sequence each step, an empty past."""
    session = ort.InferenceSession(model.SerializeToString())
    out = []
    for prompt in prompts:
        sequence = list(prompt)
        for _ in range(n):
            sequence.append(int(run_whole(session, np.array([sequence], np.int64))[0, -1].argmax()))
        out.append(sequence[len(prompt) :])
    return out
