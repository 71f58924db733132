"""The measurements of ``tessera calibrate``, run on every rank at once (started by
:func:`tessera.executor.launcher.launch_workers`): fp32 matmul rate, memory bandwidth, the torch
executor's cost per operator, gloo point-to-point round trips between rank pairs and all-reduces.
:mod:`tessera.executor.calibrate` turns them into a cluster spec. Details: docs/executor.md.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

# Fractions of the --seconds budget each phase may spend (the start-up of the workers is extra).
BUDGET = {
    "matmul": 0.17,
    "bandwidth": 0.15,
    "per_op": 0.15,
    "decode_op": 0.08,
    "p2p": 0.12,
    "p2p_loaded": 0.1,
    "decode_exchange": 0.08,
    "allreduce": 0.15,
}
MIN_REPEATS = 3
DECODE_ROUNDS = 6  # rounds of the decode phases, each variant measured in turn
MAX_REPEATS = 1000
MATMUL_SIZES = (256, 512, 1024, 2048)
MATMUL_MIN_S = 0.01  # the first size whose product takes this long is timed (tens of ms)
COPY_BYTES = 128 * 2**20  # well beyond the last-level cache
CHAIN_NODES = (40, 200)  # two chain lengths: the per-node cost is the slope between them
CHAIN_WIDTH = 8  # the chain's tensor is [1, CHAIN_WIDTH]
P2P_BYTES = (4, 2**10, 2**16, 2**20, 2**22, 2**24)  # 4 B … 16 MiB
ALLREDUCE_BYTES = (4, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24)  # 4 B … 16 MiB
LOADED_COMPUTE_S = 1e-3  # the loaded phase: each side computes this long per message
LOADED_BYTES = 2**12
CHAIN_OPSET = 17


@dataclass(frozen=True)
class CalibrateWorkerSpec:
    """What every rank gets (picklable)."""

    world_size: int
    threads: int
    seconds: float
    timeout_s: float


def calibrate_worker(spec: CalibrateWorkerSpec) -> dict[str, Any]:
    """The entry point of every rank: join the gloo group, then run each phase on all ranks at once
    (a barrier before each), so that ranks share the cores and memory as a launch's workers do."""
    import torch
    import torch.distributed as dist

    from tessera.executor.launcher import WATCHDOG_FACTOR, Watchdog, worker_setup

    rank, _ = worker_setup(spec.world_size, "gloo")
    torch.set_num_threads(spec.threads)
    watchdog = Watchdog(WATCHDOG_FACTOR * spec.timeout_s, rank)
    phases: dict[str, Callable[[float], Any]] = {
        "matmul": measure_matmul,
        "bandwidth": measure_bandwidth,
        "per_op": measure_per_op,
        "decode_op": measure_decode_op,
        "p2p": lambda budget: measure_p2p(rank, spec.world_size, budget),
        "p2p_loaded": lambda budget: measure_p2p_loaded(rank, spec.world_size, budget),
        "decode_exchange": lambda budget: measure_decode_exchange(rank, spec.world_size, budget),
        "allreduce": lambda budget: measure_allreduce(rank, budget),
    }
    result: dict[str, Any] = {"rank": rank, "threads": torch.get_num_threads()}
    try:
        watchdog.arm("start-up")
        dist.init_process_group("gloo", timeout=timedelta(seconds=spec.timeout_s))
        for name, measure in phases.items():
            watchdog.arm(f"measuring {name}")
            dist.barrier()
            result[name] = measure(BUDGET[name] * spec.seconds)
        dist.barrier()
    finally:
        watchdog.disarm()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return result


def repeat(fn: Callable[[], Any], budget_s: float) -> list[Any]:
    """``fn()``'s results over repeats until ``budget_s`` is spent (at least :data:`MIN_REPEATS`,
    at most :data:`MAX_REPEATS`), after one warm-up call whose result is left out."""
    fn()
    results: list[Any] = []
    deadline = time.perf_counter() + budget_s
    while len(results) < MAX_REPEATS and (len(results) < MIN_REPEATS or time.perf_counter() < deadline):
        results.append(fn())
    return results


def median_time(fn: Callable[[], Any], budget_s: float) -> float:
    """Median seconds of ``fn()`` (:func:`repeat`)."""

    def timed() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return statistics.median(repeat(timed, budget_s))


def measure_matmul(budget_s: float) -> dict[str, float]:
    """fp32 ``torch.mm`` of ``n x n`` matrices, ``n`` the first of :data:`MATMUL_SIZES` whose product
    takes :data:`MATMUL_MIN_S`: ``2 n^3`` FLOPs over the median time."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        out = torch.empty(n, n)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        if time.perf_counter() - t0 >= MATMUL_MIN_S:
            break
    seconds = median_time(lambda: torch.mm(a, b, out=out), budget_s)
    return {"n": n, "seconds": seconds, "flops_per_s": 2 * n**3 / seconds}


def measure_bandwidth(budget_s: float) -> dict[str, float]:
    """A :data:`COPY_BYTES` fp32 tensor copied (bytes read + written over the median time, the
    bytes the cost model charges an operator) and summed (bytes read)."""
    import torch

    src = torch.ones(COPY_BYTES // 4)
    dst = torch.zeros_like(src)  # both touched before timing: no page faults in the loop
    copy_s = median_time(lambda: dst.copy_(src), budget_s / 2)
    sum_s = median_time(lambda: src.sum(), budget_s / 2)
    return {
        "bytes": COPY_BYTES,
        "copy_bytes_per_s": 2 * COPY_BYTES / copy_s,
        "sum_bytes_per_s": COPY_BYTES / sum_s,
    }


def chain_model(nodes: int) -> Any:
    """An ONNX model of ``nodes`` small operators in a chain: ``Add`` and ``Mul`` by scalar
    constants in turn, on a ``[1, CHAIN_WIDTH]`` fp32 tensor (values stay near 1)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    ops, inits = [], []
    previous = "x"
    for i in range(nodes):
        kind, value = ("Add", 0.5) if i % 2 == 0 else ("Mul", 0.6)
        const = f"c{i}"
        inits.append(numpy_helper.from_array(np.array(value, dtype=np.float32), const))
        out = "y" if i == nodes - 1 else f"t{i}"
        ops.append(helper.make_node(kind, [previous, const], [out], name=f"n{i}"))
        previous = out
    graph = helper.make_graph(
        ops,
        f"chain{nodes}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHAIN_WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CHAIN_WIDTH])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", CHAIN_OPSET)])
    onnx.checker.check_model(model)
    return model


def measure_per_op(budget_s: float) -> dict[str, Any]:
    """The cost of one operator in tessera's training executor (``OnnxModule``): chains of
    :data:`CHAIN_NODES` nodes, in turn, run forward and then backward from the sum of the output;
    the slope between the two lengths leaves out what a call costs whatever its length (the loss,
    autograd's start)."""
    import torch

    from tessera.backends.torch_module import OnnxModule

    x = torch.ones(1, CHAIN_WIDTH, requires_grad=True)
    modules = [OnnxModule(chain_model(n), label=f"chain{n}") for n in CHAIN_NODES]

    def step() -> list[tuple[float, float]]:
        times = []
        for module in modules:
            t0 = time.perf_counter()
            (y,) = module(x)
            t1 = time.perf_counter()
            y.sum().backward()
            times.append((t1 - t0, time.perf_counter() - t0))
        return times

    runs = repeat(step, budget_s)
    (short, long), span = CHAIN_NODES, CHAIN_NODES[1] - CHAIN_NODES[0]

    def slope(which: int) -> float:  # which: 0 the forward, 1 forward + backward
        short_s = statistics.median(r[0][which] for r in runs)
        long_s = statistics.median(r[1][which] for r in runs)
        return (long_s - short_s) / span

    return {"nodes": [short, long], "forward_s": slope(0), "forward_backward_s": slope(1)}


@functools.cache
def _zoo_decoder(compiled: bool) -> Any:
    """The zoo's tiny GPT as a decode rank runs it, traced, or compiled by torch.compile's inductor
    as ``launch --compile`` runs it (built once per process: the decode phases share it)."""
    from tessera.core.weights import materialize
    from tessera.executor.decode_program import compile_step
    from tessera.executor.graph_decode_worker import graph_decoder
    from tessera.models import build

    decoder = graph_decoder(materialize(build("gpt", "tiny", seed=0, seq=512)), label="zoo gpt tiny")
    if compile_step(decoder, 1, 1, inductor=compiled) is not None:
        raise RuntimeError("the zoo GPT's decode step did not compile")
    return decoder


def measure_decode_op(budget_s: float) -> dict[str, Any]:
    """The host time of one operation of a decode step: the zoo's tiny GPT decoded as a dp rank
    decodes it, its median step over the operations the cp cost model counts for it; traced
    (``op_s``) and compiled by torch.compile's inductor as ``launch --compile`` runs it
    (``compiled_op_s``; its compilation, seconds, comes on top of the budget). The two alternate in
    :data:`DECODE_ROUNDS` rounds, each the median of its steps, and each is the median of its
    rounds: a slow spell of the host moves one round, not the result."""
    from tessera.executor.decode_program import step_operations
    from tessera.executor.graph_decode_worker import time_decode_step

    traced, compiled = _zoo_decoder(False), _zoo_decoder(True)
    operations = step_operations(traced) or 1
    t0 = time.perf_counter()
    for stepped in (traced, compiled):
        time_decode_step(stepped, 8)  # warm-up, and how long a step takes (its prefill included)
    steps = max(8, min(256, int(budget_s / 2 / DECODE_ROUNDS / max(time.perf_counter() - t0, 1e-6) * 16)))
    rounds = [
        (time_decode_step(traced, steps), time_decode_step(compiled, steps)) for _ in range(DECODE_ROUNDS)
    ]
    step_s = statistics.median(r[0] for r in rounds)
    compiled_s = statistics.median(r[1] for r in rounds)
    return {
        "operations": operations,
        "step_s": step_s,
        "op_s": step_s / operations,
        "compiled_step_s": compiled_s,
        "compiled_op_s": compiled_s / operations,
    }


def _pair_of(rank: int, world_size: int) -> int | None:
    """The rank's partner in the point-to-point phase: ranks 2k and 2k+1 (a last odd rank: none)."""
    peer = rank ^ 1
    return peer if peer < world_size else None


def _agree_repeats(rank: int, first_s: float, budget_s: float, src: int, peer: int | None) -> int:
    """The repeats of a timing loop, the same on every rank taking part (the loops must match call
    for call): ``src`` picks them from its warm-up time and sends them to ``peer``, or to every
    rank when ``peer`` is None."""
    import torch
    import torch.distributed as dist

    count = torch.tensor([max(MIN_REPEATS, min(MAX_REPEATS, int(budget_s / max(first_s, 1e-7))))])
    if peer is None:
        dist.broadcast(count, src)
    elif rank == src:
        dist.send(count, peer)
    else:
        dist.recv(count, src)
    return int(count.item())


def measure_p2p(rank: int, world_size: int, budget_s: float) -> dict[str, Any] | None:
    """Round trips of :data:`P2P_BYTES` messages between ranks 2k and 2k+1, every pair at once;
    the even rank times them and reports half the median round trip (one way). None on a rank
    without a partner or on the odd rank of a pair."""
    import torch
    import torch.distributed as dist

    peer = _pair_of(rank, world_size)
    if peer is None:
        return None
    sender = rank < peer
    one_way = []
    for nbytes in P2P_BYTES:
        buf = torch.zeros(max(1, nbytes // 4))

        def round_trip(buf: torch.Tensor = buf) -> None:
            if sender:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        t0 = time.perf_counter()
        round_trip()  # warm-up: gloo makes its buffers lazily
        first = time.perf_counter() - t0
        repeats = _agree_repeats(rank, first, budget_s / len(P2P_BYTES), min(rank, peer), peer)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            round_trip()
            times.append(time.perf_counter() - t0)
        one_way.append(statistics.median(times) / 2)
    if not sender:
        return None
    return {"bytes": list(P2P_BYTES), "one_way_s": one_way, "pair": [rank, peer]}


def measure_p2p_loaded(rank: int, world_size: int, budget_s: float) -> dict[str, Any] | None:
    """A pipeline's messages, between ranks 2k and 2k+1, as the stage workers pass them: the odd
    rank posts every receive first (``irecv``); the even rank computes :data:`LOADED_COMPUTE_S`,
    then sends (``isend``) a :data:`LOADED_BYTES` message and goes on computing; the odd rank
    waits for each message, then computes a little longer (so the message is there when it
    looks). Each side times its own part of a message with the buffer handling the workers do:
    the sender's ``isend``, the receiver's buffer, ``irecv`` and wait for an arrived message (the
    link's overhead)."""
    import torch
    import torch.distributed as dist

    peer = _pair_of(rank, world_size)
    if peer is None:
        return None
    sender = rank < peer
    a = torch.randn(128, 128)

    def compute(seconds: float) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ a

    messages = _agree_repeats(rank, 2 * LOADED_COMPUTE_S, budget_s, min(rank, peer), peer)
    out = torch.randn(LOADED_BYTES // 4)
    spent: list[float] = []
    if sender:
        sends = []
        for k in range(messages + 1):
            compute(LOADED_COMPUTE_S)
            t0 = time.perf_counter()
            payload = out.detach().reshape(-1)
            sends.append((dist.isend(payload, peer, tag=k), payload))
            spent.append(time.perf_counter() - t0)
        for work, _ in sends:
            work.wait()
        return {"bytes": LOADED_BYTES, "send_s": statistics.median(spent), "pair": [rank, peer]}
    t0 = time.perf_counter()
    posted = []
    for k in range(messages + 1):
        flat = torch.empty(LOADED_BYTES // 4)
        posted.append((dist.irecv(flat, peer, tag=k), flat))
    post = (time.perf_counter() - t0) / (messages + 1)
    waited = []
    for work, flat in posted:
        t0 = time.perf_counter()
        work.wait()
        flat.split([flat.numel()])[0].view(-1).detach()
        waited.append(time.perf_counter() - t0)
        compute(LOADED_COMPUTE_S * 1.25)
    # The first wait is for the sender's first compute; later messages have arrived.
    return {"bytes": LOADED_BYTES, "receive_s": post + statistics.median(waited[1:]), "pair": [peer, rank]}


def measure_decode_exchange(rank: int, world_size: int, budget_s: float) -> dict[str, Any] | None:
    """A decode step's exchanges between the ranks of this host as tp and cp launches run them
    (``executor.shm_gather``), measured inside a decode step: the zoo's tiny GPT, compiled, decoded
    on every rank at once, its cores' outputs all-gathered between the ranks once a layer, twice a
    layer, or not at all, in alternate rounds. The second gather of a layer, back to back with the
    first, is what one exchange costs (``exchange_s``); the first costs more: it waits for the later
    rank, whose step the VM stretches now and then, a fraction of the step (``rank_skew``: of the
    step without exchanges). Each the median over the rounds; None where the ranks cannot share
    memory."""
    import torch

    from tessera.executor.graph_decode_worker import time_decode_step
    from tessera.executor.shm_gather import ShmGather, usable

    if not usable(world_size):
        return None
    gather = ShmGather(rank, world_size, 1 << 20, 60.0)  # a prefill's core output fits
    decoder = _zoo_decoder(True)
    layers = len(decoder.cores)

    def once(o: torch.Tensor) -> torch.Tensor:
        return gather.stacked(o)[rank]

    def twice(o: torch.Tensor) -> torch.Tensor:
        return once(once(o))

    t0 = time.perf_counter()
    time_decode_step(decoder, 8, exchange=twice)  # warm-up, and how long a step takes
    steps = _agree_repeats(rank, (time.perf_counter() - t0) / 8, budget_s / 3 / DECODE_ROUNDS, 0, None)
    exchange, skew = [], []
    for _ in range(DECODE_ROUNDS):  # a round's differences: the VM's slower moments move all three
        alone, one, two = (time_decode_step(decoder, steps, exchange=e) for e in (None, once, twice))
        exchange.append(max(two - one, 0.0) / layers)
        skew.append(max(one - alone - layers * exchange[-1], 0.0) / alone)
    return {"exchange_s": statistics.median(exchange), "rank_skew": statistics.median(skew)}


def measure_allreduce(rank: int, budget_s: float) -> dict[str, Any]:
    """Sum all-reduces of :data:`ALLREDUCE_BYTES` over every rank (gloo), back to back, and a
    ZeRO-1 step's pair on the same buffers (reduce-scatter, then all-gather of the shards, as
    ``executor.zero`` runs them: through shared memory where the ranks share a host); each rank's median per call (the launcher reports the slowest
    rank's)."""
    import torch
    import torch.distributed as dist

    from tessera.executor.zero import gather_shards, host_exchange, scatter_sum

    ranks = dist.get_world_size()
    seconds, pairs = [], []
    shm = host_exchange(max(ALLREDUCE_BYTES), None, 60.0)  # the pair as a ZeRO-1 stage runs it
    for nbytes in ALLREDUCE_BYTES:
        buf = torch.zeros(max(ranks, nbytes // 4 // ranks * ranks))
        shard = torch.zeros(buf.numel() // ranks)

        def pair(buf: torch.Tensor = buf, shard: torch.Tensor = shard) -> None:
            scatter_sum(shard, buf, shm=shm)
            gather_shards(buf, shard, shm=shm)

        for call, into in ((lambda buf=buf: dist.all_reduce(buf), seconds), (pair, pairs)):
            t0 = time.perf_counter()
            call()  # warm-up
            first = time.perf_counter() - t0
            repeats = _agree_repeats(rank, first, budget_s / len(ALLREDUCE_BYTES) / 2, 0, None)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            into.append(statistics.median(times))
    return {"bytes": list(ALLREDUCE_BYTES), "seconds": seconds, "zero_seconds": pairs}
