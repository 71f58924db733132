"""The ground truth of a decode: greedy tokens of onnxruntime running a decoder's whole ONNX graph on
the growing sequence (fp32, no KV cache), each request alone."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from cli_runner import run_cli

from tessera.core.plans import CpPlan
from tessera.core.weights import materialize
from tessera.executor.cp_run import make_prompts
from tessera.executor.decode_program import compile_step
from tessera.executor.graph_decoder import GraphDecoder
from tessera.executor.graphed_step import GraphedStep
from tessera.executor.kv_cache import GroupCache, attention_partial
from tessera.models.gpt import llm_gpt


def greedy_tokens(
    model: str | Path | onnx.ModelProto, prompts: Sequence[Sequence[int]], n: int
) -> list[list[int]]:
    """``n`` greedy tokens after each prompt (argmax, first index on ties)."""
    session = free_session(model)
    names = [i.name for i in session.get_inputs()]
    out = []
    for prompt in prompts:
        sequence, tokens = list(prompt), []
        for _ in range(n):
            ids = np.array([sequence], dtype=np.int64)
            # an attention mask of ones, positions 0..S-1, beside the token ids
            feeds = {
                name: np.ones_like(ids)
                if "mask" in name
                else np.arange(ids.shape[1])[None]
                if "position" in name
                else ids
                for name in names
            }
            logits = session.run(None, feeds)[0]
            tokens.append(int(logits[0, -1].argmax()))
            sequence.append(tokens[-1])
        out.append(tokens)
    return out


def torch_greedy(module: torch.nn.Module, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """A torch module's own ``n`` greedy tokens after each prompt, recomputing the whole sequence
    each token (no cache; ``module`` maps ``[1, S]`` ids to ``[1, S, vocab]`` logits)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(module(torch.tensor([ids]))[0, -1].float().argmax()))
            out.append(ids[len(prompt) :])
    return out


def free_session(model: str | Path | onnx.ModelProto) -> ort.InferenceSession:
    """An onnxruntime session of ``model`` with its sequence axis left free: a model that declares
    a fixed length but computes any (tessera's zoo GPT) runs at every length."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    free = onnx.ModelProto()
    free.CopyFrom(proto)
    for value in (*free.graph.input, *free.graph.output):
        dims = value.type.tensor_type.shape.dim
        if len(dims) >= 2:
            dims[1].dim_param = "sequence"  # clears a fixed dim_value
    return ort.InferenceSession(free.SerializeToString(), providers=["CPUExecutionProvider"])


def plan_tokens(
    plan: CpPlan, model: str | Path | None, lens: Sequence[int], seed: int, n: int
) -> list[list[int]]:
    """What a launch of ``plan`` must produce for ``launch --prompt-lens lens --seed seed``: the
    seeded prompts, decoded by the plan's ONNX model, or by its ``--llm`` config's GPT."""
    decoder = materialize(llm_gpt(plan.llm, seed)) if model is None else model
    return greedy_tokens(decoder, make_prompts(int(plan.llm["vocab"]), lens, seed), n)


def group_tokens(
    decoder: GraphDecoder, prompts: list[list[int]], new: int, *, fixed: bool, device: str = "cpu"
) -> list[list[int]]:
    """Greedy tokens of one group of requests, each step the fixed-shape one (``fixed``) or the
    dynamic-shape one (attending over the slots written so far); on a CUDA ``device`` the fixed
    step is captured as a CUDA graph."""
    batch, length = len(prompts), len(prompts[0])
    on = torch.device(device)
    decoder.module.to(on)  # before tracing: a program reads the weights where they were traced
    for key in ((batch, length), (batch, 1)):
        assert compile_step(decoder, *key) is None
    cache = GroupCache(np.zeros(length + new - 1, dtype=np.int64), 0, on)

    def attend(layer, q, k, v, scores, past):
        keys, values, positions = cache.read(layer, cache.write(layer, k, v, past))
        q_pos = torch.arange(past, past + q.shape[2], device=on)
        return attention_partial(q, keys, values, q_pos, positions, scores)[0]

    steps = [
        torch.argmax(decoder.logits(torch.tensor(prompts, device=on), 0, attend)[:, -1], dim=-1).tolist()
    ]
    graphed = GraphedStep(decoder, cache, batch, capture=on.type == "cuda") if fixed else None
    for k in range(new - 1):
        if graphed is not None:
            steps.append(graphed.run(steps[-1], length + k))
        else:
            logits = decoder.logits(torch.tensor(steps[-1], device=on)[:, None], length + k, attend)
            steps.append(torch.argmax(logits[:, -1], dim=-1).tolist())
    assert cache.positions_held == length + new - 1
    if graphed is not None and on.type == "cuda":
        assert graphed.graph is not None, graphed.why_not
    return [list(t) for t in zip(*steps, strict=True)]


def assert_launches_decode(
    model: str, prompts: list, want: list, strategies: tuple, tmp_path, batch: int = 4, new_tokens: int = 5
) -> None:
    """``plan --kind cp --batch batch`` of ``model`` for each strategy on 2 ranks, then ``launch``
    with ``prompts``: the tokens are ``want``."""
    lines = tmp_path / "prompts.txt"
    lines.write_text("".join(" ".join(map(str, p)) + "\n" for p in prompts))
    for strategy in strategies:
        plan = tmp_path / f"{strategy}.json"
        planned = run_cli(
            "plan", model, "--kind", "cp", "--cluster", "local-cpu-split", "--batch", str(batch),
            "--context", "10", "--output-len", str(new_tokens), "--strategy", strategy, "--degree", "2", "-o", str(plan),
        )  # fmt: skip
        assert planned.code == 0, planned.err
        launched = run_cli(
            "launch", str(plan), "--model", model, "--prompts", str(lines), "--new-tokens", str(new_tokens),
            "--json", "--timeout", "60",
        )  # fmt: skip
        assert launched.code == 0, launched.err
        assert json.loads(launched.out)["tokens"] == want, strategy
