"""Hand-built GPP plans for executor tests and benchmarks (no dependency on the GPP planner).

:func:`make_plan` turns stages given as (nodes, devices, micro-batch size) into a valid
:class:`GppPlan`: edges and their tensors from the operator graph, 1F1B schedules whose warm-up is
the stage's depth to the sink (+1), exact in-flight counts, and a made-up prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import networkx as nx
import onnx

from tessera.core.graph import Graph, load_graph
from tessera.core.plans import (
    EdgeTensor,
    GppPlan,
    ModelRef,
    SharedWeight,
    Stage,
    StageEdge,
    StageMemory,
    StageSchedule,
    TrainingSetup,
    write_plan,
)
from tessera.core.specs import ClusterSpec
from tessera.planners.pipeline.checks import counted_memory

StageSpec = tuple[Sequence[str], Sequence[str], int]  # nodes, devices, micro-batch size


def one_f_one_b(m: int, warmup: int) -> list[str]:
    w = max(1, min(warmup, m))
    actions = [f"F{i}" for i in range(w)]
    f = w
    for b in range(m):
        actions.append(f"B{b}")
        if f < m:
            actions.append(f"F{f}")
            f += 1
    return actions


def gpipe(m: int) -> list[str]:
    return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]


def in_flight(actions: Sequence[str]) -> int:
    live = peak = 0
    for a in actions:
        live += 1 if a[0] == "F" else -1
        peak = max(peak, live)
    return peak


def make_plan(
    graph: Graph,
    stages: Sequence[StageSpec],
    mini_batch: int,
    *,
    schedule: str = "1f1b",
    predicted_iteration_s: float = 0.01,
    kind: str = "gpp",
    zero: Sequence[int] = (),
    tensor_parallel: int = 1,
) -> GppPlan:
    cluster, device_id = _cluster_of([d for _, devices, _ in stages for d in devices])
    stage_of = {n: i for i, (nodes, _, _) in enumerate(stages) for n in nodes}
    tensors: dict[tuple[int, int], dict[str, int]] = {}
    for u, v, data in graph.dag.edges(data=True):
        su, sv = stage_of[u], stage_of[v]
        if su != sv:
            for t in data["tensors"]:
                tensors.setdefault((su, sv), {})[t.name] = t.nbytes
    dag = nx.DiGraph(list(tensors))
    dag.add_nodes_from(range(len(stages)))
    depth = {s: 0 for s in dag}
    for s in reversed(list(nx.topological_sort(dag))):
        depth[s] = max((depth[d] + 1 for d in dag.successors(s)), default=0)
    built = []
    for i, (nodes, devices, b) in enumerate(stages):
        m = mini_batch // b
        actions = gpipe(m) if schedule == "gpipe" else one_f_one_b(m, depth[i] + 1)
        built.append(
            Stage(
                id=i,
                nodes=list(nodes),
                devices=[device_id[d] for d in devices],
                micro_batch_size=b,
                schedule=StageSchedule(kind=schedule, actions=actions),
                in_flight=in_flight(actions),
                zero=1 if i in zero else 0,  # ZeRO-1 over the stage's replicas
                tensor_parallel=tensor_parallel,  # devices: replica by replica
                memory=StageMemory(weights=0, optimizer=0, activations=0, peak=0),  # counted below
                predicted={"busy_s": predicted_iteration_s / 2, "peak_memory_bytes": 1e6},
            )
        )
    edges = [
        StageEdge(
            src=s, dst=d, tensors=[EdgeTensor(name=n, bytes=x) for n, x in t.items()], bytes=sum(t.values())
        )
        for (s, d), t in sorted(tensors.items())
    ]
    # Eq. 3.2 as validate counts it, so the hand-built plan records its true memory.
    device_type = ClusterSpec.from_json_dict(cluster).devices()[0].type
    groups = [nodes for nodes, _, _ in stages]
    copies, owned = graph.shared_copies(groups), graph.shared_owned(groups)
    training = TrainingSetup(zero="auto" if zero else 0)
    for i, st in enumerate(built):
        mem = counted_memory(st, graph, device_type, training, copies[i], owned[i])
        built[i] = st.model_copy(
            update={
                "memory": StageMemory(
                    weights=mem.weights, optimizer=mem.optimizer, activations=mem.activations, peak=mem.peak
                )
            }
        )
    return GppPlan(
        kind=kind,
        model=ModelRef.of(graph),
        cluster=cluster,
        mini_batch_size=mini_batch,
        stages=built,
        edges=edges,
        training=training,
        shared_weights=[
            SharedWeight(name=w, stages=readers, bytes=graph.initializers[w].nbytes)
            for w, readers in graph.shared_weights([nodes for nodes, _, _ in stages]).items()
        ],
        predicted={
            "iteration_time_s": predicted_iteration_s,
            "throughput_samples_per_s": mini_batch / predicted_iteration_s,
        },
    )


def _cluster_of(names: Sequence[str]) -> tuple[dict, dict[str, str]]:
    """A one-node cluster of CPU cores, one per distinct device name (in order of appearance),
    and the cluster's device id for each name: ``validate`` checks C3 against the plan's cluster."""
    order = list(dict.fromkeys(names))
    spec = ClusterSpec.from_json_dict(
        {
            "name": "hand-built",
            "device_types": {
                "cpu": {"kind": "cpu", "memory": 8 << 30, "flops": {"fp32": 1e11}, "memory_bandwidth": 1e10}
            },
            "nodes": [{"name": "host", "count": 1, "devices": [{"type": "cpu", "count": len(order)}]}],
            "links": {"intra_node": {"bandwidth": 2e9, "latency": 8e-5}},
        }
    )
    ids = [d.id for d in spec.devices()]
    return spec.to_json_dict(), dict(zip(order, ids, strict=True))


def save_model(model: onnx.ModelProto, path: Path) -> Graph:
    path.write_bytes(model.SerializeToString())
    return load_graph(str(path))


def write(plan: GppPlan, path: Path) -> Path:
    return write_plan(plan, path)


# -- the stage splits the tests use ----------------------------------------------------------------


def candle_dag(graph: Graph) -> list[list[str]]:
    """candle_uno: branches 0–3 | branches 4–6 | the merge (concat + head): two stages feed a third."""
    a = [n for n in graph.order if n.startswith(("branch0/", "branch1/", "branch2/", "branch3/"))]
    b = [n for n in graph.order if n.startswith(("branch4/", "branch5/", "branch6/"))]
    rest = [n for n in graph.order if n not in set(a) | set(b)]
    return [a, b, rest]


def mmt_dag(graph: Graph) -> list[list[str]]:
    """mmt: branch 0 | branch 1 | merge + head."""
    a = [n for n in graph.order if n.startswith("branch0/")]
    b = [n for n in graph.order if n.startswith("branch1/")]
    rest = [n for n in graph.order if n not in set(a) | set(b)]
    return [a, b, rest]


def chain_halves(graph: Graph) -> list[list[str]]:
    """The model's node order cut in two halves (convex: a prefix and a suffix of a topological order)."""
    half = len(graph.order) // 2
    return [list(graph.order[:half]), list(graph.order[half:])]
