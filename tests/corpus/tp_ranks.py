"""A stage run on ``t`` gloo ranks as tensor-parallel blocks (core.tp_program.local_model)
against the whole stage in one process: outputs, input gradients and every weight's gradient
(a split weight's against its block of the whole gradient)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tessera.backends.torch_module import to_torch
from tessera.backends.torch_ops.collectives import use_group
from tessera.core.graph import load_graph
from tessera.core.tensor_parallel import shard, tensor_parallel
from tessera.core.tp_program import local_model


def _rank(rank: int, t: int, store: str, path: str, shapes: dict, run_batch: int, drop: str, out) -> None:
    # A file store: no port to race other processes for.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=t)
    torch.set_num_threads(1)
    try:
        graph = load_graph(path, input_shapes=shapes)
        split = tensor_parallel(graph, t)
        use_group("tp", dist.group.WORLD)
        model = local_model(graph, graph.order, split, rank)
        if drop:  # a mutation: the collectives of one kind left out (identity in their place)
            for node in model.graph.node:
                if node.op_type == drop:
                    node.op_type = "Identity"
                    del node.attribute[:]
        rng = np.random.default_rng(0)
        feeds = [
            torch.from_numpy(rng.integers(0, 16, (run_batch, *i.shape[1:])).astype(i.dtype))
            for i in graph.inputs.values()
        ]
        results = []
        for module in (to_torch(graph.extract(graph.order)), to_torch(model)):
            outputs = module(*feeds)
            weigh = torch.Generator().manual_seed(7)
            loss = sum(
                (o * torch.randn(o.shape, generator=weigh)).sum() for o in outputs if o.is_floating_point()
            )
            loss.backward()
            grads = {n: p.grad for n, p in module.onnx_parameters() if p.grad is not None}
            results.append(([o.detach() for o in outputs], grads))
        (want_out, want_grads), (got_out, got_grads) = results
        blocks = split.weights
        worst = max(_rel(a, b) for a, b in zip(want_out, got_out, strict=True))
        for name, grad in want_grads.items():
            if name in blocks:
                axis, parts = blocks[name]
                grad = torch.from_numpy(shard(grad.numpy(), axis, t, rank, parts))
            worst = max(worst, _rel(grad, got_grads[name]))
        out.put((rank, len(split.regions), worst))
    finally:
        dist.destroy_process_group()


def _rel(want: torch.Tensor, got: torch.Tensor) -> float:
    return float((want - got).abs().max() / (want.abs().max() + 1e-12))


def tp_errors(
    path: str, t: int, shapes: dict, run_batch: int, drop: str = ""
) -> list[tuple[int, int, float]]:
    """(rank, regions, worst relative error) of each of the ``t`` ranks, the graph loaded at
    ``shapes`` and run at a micro-batch of ``run_batch``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = str(Path(folder) / "store")
        procs = [
            ctx.Process(target=_rank, args=(r, t, store, path, shapes, run_batch, drop, out))
            for r in range(t)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return sorted(out.get(timeout=10) for _ in range(t))
