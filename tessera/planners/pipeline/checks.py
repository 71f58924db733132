"""Validity of a GPP/SPP plan: GraphPipe's constraints C1–C5 and Eq. 3.2 memory, counted again from
the model, plus what the executor needs. Registered in :data:`tessera.core.plans.PLAN_CHECKS` for
kinds ``gpp`` and ``spp`` when imported (:mod:`.plan` imports it), so ``tessera validate`` runs it.

References: GraphPipe thesis §3.3, Eq. 3.2.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from tessera.backends.torch_module import unsupported_operators
from tessera.core.cost import CostModel, per_device_samples
from tessera.core.external_data import unread_weights
from tessera.core.plans import PLAN_CHECKS
from tessera.core.schedule import SCHEDULE_KINDS, in_flight_of, schedule_problems
from tessera.core.tensor_parallel import TpSplit, tensor_parallel
from tessera.planners.pipeline.memory import (
    StageMemoryEstimate,
    sharded_optimizer,
    stage_memory,
    tensor_parallel_share,
)
from tessera.planners.sim import SimEdge, SimStage, simulate

# Recounted memory may differ from the planner's by float rounding (sums in another order).
_MEMORY_SLACK = 64


def check_gpp_plan(plan: Any, graph: Any) -> list[str]:
    """Everything a gpp or spp plan must hold against its model (C1-C5 of docs/gpp.md, memory,
    shared weights, what launch can train): one line per problem, empty if none."""
    problems, crossing = _partition_problems(plan, graph)
    found, known = _device_problems(plan)
    problems.extend(found)
    for st in plan.stages:
        problems.extend(_stage_problems(plan, st, known))
    problems.extend(_edge_problems(plan, crossing))
    if not any(p.startswith(("C1", "C4")) for p in problems):
        sim_stages = [
            SimStage(st.id, st.micro_batch_size, 1.0, 2.0, tuple(st.schedule.actions)) for st in plan.stages
        ]
        sim_edges = [SimEdge(e.src, e.dst) for e in plan.edges]
        try:
            simulate(sim_stages, sim_edges, plan.mini_batch_size)
        except ValueError as exc:
            problems.append(f"C5: {exc}")
    problems.extend(_shared_weight_problems(plan, graph))
    if (why := graph.fixed_batch_message()) is not None:
        problems.append(f"launch cannot train it: {why}")
    if (why := untrainable_message(graph)) is not None:
        problems.append(f"launch cannot train it: {why}")
    if known is not None and not any(p.startswith(("C1", "C3")) for p in problems):
        problems.extend(_memory_problems(plan, graph, known))
    return problems


def _partition_problems(plan: Any, graph: Any) -> tuple[list[str], dict[tuple[int, int], set[str]]]:
    """C1 (every node in exactly one stage, the stages convex) and C2 (an edge wherever a stage feeds
    another), with the tensors crossing from stage to stage."""
    problems: list[str] = []
    stage_of: dict[str, int] = {}
    for st in plan.stages:
        for n in st.nodes:
            if n in stage_of:
                problems.append(f"C1: node {n!r} is in stages {stage_of[n]} and {st.id}")
            stage_of[n] = st.id
    missing = [n for n in graph.order if n not in stage_of]
    if missing:
        problems.append(f"C1: {len(missing)} node(s) in no stage, first {missing[0]!r}")
    quotient = nx.DiGraph()
    quotient.add_nodes_from(st.id for st in plan.stages)
    crossing: dict[tuple[int, int], set[str]] = {}  # tensors from stage to stage
    for u, v, data in graph.dag.edges(data=True):
        su, sv = stage_of.get(u), stage_of.get(v)
        if su is not None and sv is not None and su != sv:
            quotient.add_edge(su, sv)
            crossing.setdefault((su, sv), set()).update(t.name for t in data["tensors"])
    if not nx.is_directed_acyclic_graph(quotient):
        problems.append("C1: a stage is not convex (the stages' quotient graph has a cycle)")
    declared = {(e.src, e.dst) for e in plan.edges}
    for su, sv in sorted(set(crossing) - declared):
        problems.append(f"C2: operators of stage {su} feed stage {sv} but the plan has no edge {su}->{sv}")
    return problems, crossing


def _device_problems(plan: Any) -> tuple[list[str], dict[str, Any] | None]:
    """C3 (every device in one stage, and in the plan's cluster), with the cluster's devices by id
    (None where the plan records no readable cluster)."""
    problems: list[str] = []
    known = None
    if not plan.cluster:  # tessera plan always records it; without it C3 and memory go unchecked
        problems.append("cluster: the plan records no cluster, so C3 and device memory cannot be checked")
    else:
        from tessera.core.specs import ClusterSpec

        try:
            cluster = ClusterSpec.from_json_dict(plan.cluster)
            known = {d.id: d for d in cluster.devices()}
        except Exception as exc:  # noqa: BLE001 - reported as a problem
            problems.append(f"cluster: {exc}")
    owner: dict[str, int] = {}
    for st in plan.stages:
        for dev in st.devices:
            if dev in owner:
                problems.append(f"C3: device {dev!r} is in stages {owner[dev]} and {st.id}")
            owner[dev] = st.id
            if known is not None and dev not in known:
                problems.append(f"C3: stage {st.id} names device {dev!r}, not in the cluster")
    return problems, known


def _stage_problems(plan: Any, st: Any, known: dict[str, Any] | None) -> list[str]:
    """One stage's own rules: its micro-batch, C4 (its schedule), replicas, in-flight count, memory."""
    if plan.mini_batch_size % st.micro_batch_size:
        return [f"stage {st.id}: micro-batch {st.micro_batch_size} does not divide the mini-batch"]
    m = plan.mini_batch_size // st.micro_batch_size
    c4 = schedule_problems(st.schedule.actions, m)
    problems = [f"C4: stage {st.id}: {p}" for p in c4]
    if not c4:
        problems.extend(_schedule_kind_problems(st, m))
    if st.micro_batch_size < st.replicas:
        problems.append(
            f"stage {st.id}: micro-batch {st.micro_batch_size} is smaller than its "
            f"{st.replicas} data-parallel replicas (a replica needs a sample)"
        )
    if st.in_flight != in_flight_of(st.schedule.actions):
        problems.append(
            f"stage {st.id}: in_flight {st.in_flight} but its schedule keeps "
            f"{in_flight_of(st.schedule.actions)} micro-batches in flight"
        )
    mem = st.memory
    if mem.peak != mem.weights + mem.optimizer + mem.activations:
        problems.append(f"memory: stage {st.id} peak is not weights + optimizer + activations")
    memories = [known[d].type.memory for d in st.devices if d in known] if known is not None else []
    if memories and mem.peak > min(memories):  # unknown devices are reported under C3
        problems.append(f"memory: stage {st.id} needs {mem.peak} bytes, its devices have {min(memories)}")
    return problems


for _kind in ("gpp", "spp"):
    if check_gpp_plan not in PLAN_CHECKS.setdefault(_kind, []):
        PLAN_CHECKS[_kind].append(check_gpp_plan)


def _schedule_kind_problems(st: Any, m: int) -> list[str]:
    """A stage's actions must be what its schedule kind generates for its in-flight count."""
    kind, k = st.schedule.kind, st.schedule.k
    if kind != "kfkb" and k != 1:
        return [f"stage {st.id}: schedule k {k} is kFkB's; a {kind} schedule has k 1"]
    generate = SCHEDULE_KINDS[kind].generate
    if generate is not None and list(st.schedule.actions) != generate(m, st.in_flight, k):
        return [f"stage {st.id}: its actions are not a {kind} schedule with {st.in_flight} in flight"]
    return []


def untrainable_operators(graph: Any) -> dict[str, list[str]]:
    """Operators the training executor has no function for (``tessera.backends.torch_module``'s
    :func:`unsupported_operators` of the graph's nodes): ``{op type: [node, …]}``."""
    ops = (graph.op(name) for name in graph.order)
    return unsupported_operators((op.name, op.op_type, op.domain) for op in ops)


def untrainable_message(graph: Any) -> str | None:
    """One line naming what launch could not train (operators, weights not in memory), or None."""
    if (why := unread_weights(graph.model)) is not None:
        return why
    found = untrainable_operators(graph)
    if not found:
        return None
    shown = ", ".join(
        f"{t} ({nodes[0]!r}{f' and {len(nodes) - 1} more' if len(nodes) > 1 else ''})"
        for t, nodes in found.items()
    )
    return f"the training executor has no function for {shown}; see docs/operators.md"


def _shared_weight_problems(plan: Any, graph: Any) -> list[str]:
    """The plan's ``shared_weights`` are the weights its stages share in the model (what launch sums
    the gradients of and the memory counts twice)."""
    found = graph.shared_weights([[n for n in st.nodes if n in graph.dag] for st in plan.stages])
    recorded = {w.name: list(w.stages) for w in plan.shared_weights}
    if recorded == found:
        return []
    missing = sorted(set(found) - set(recorded))
    if missing:
        return [f"shared_weights: {missing[0]!r} is read by stages {found[missing[0]]} but not listed"]
    wrong = sorted(w for w in recorded if recorded[w] != found.get(w))
    return [f"shared_weights: {wrong[0]!r} is read by stages {found.get(wrong[0], 'of one stage only')}"]


def _edge_problems(plan: Any, crossing: dict[tuple[int, int], set[str]]) -> list[str]:
    """Edges carry exactly the tensors that cross between their stages (``crossing``); an spp
    plan runs its stages in order."""
    problems: list[str] = []
    seen: set[tuple[int, int]] = set()
    for e in plan.edges:
        pair = (e.src, e.dst)
        if pair in seen:
            problems.append(f"edge {e.src}->{e.dst} is listed twice")
            continue
        seen.add(pair)
        names = [t.name for t in e.tensors]
        if e.bytes != sum(t.bytes for t in e.tensors):
            problems.append(f"edge {e.src}->{e.dst}: bytes {e.bytes} is not the sum of its tensors' bytes")
        want = crossing.get(pair, set())
        if set(names) != want or len(names) != len(set(names)):
            if not names and not want and plan.kind == "spp" and e.dst == e.src + 1:
                continue  # a sequential pipeline's order: stage i+1 after stage i
            extra = sorted(set(names) - want)
            missing = sorted(want - set(names))
            what = f"names {extra[0]!r}, which does not flow from stage {e.src} to {e.dst}" if extra else ""
            what = what or (f"lacks {missing[0]!r}" if missing else "lists a tensor twice")
            problems.append(f"edge {e.src}->{e.dst} {what}")
    if plan.kind == "spp":
        # A sequential pipeline runs its stages in order: every stage after the one before it
        # (the edge i->i+1), and tensors only go forward (a skip edge 0->2 carries a residual).
        missing = sorted({(i, i + 1) for i in range(len(plan.stages) - 1)} - seen)
        backward = sorted(e for e in seen if e[0] > e[1])
        if missing or backward:
            src, dst = (missing or backward)[0]
            problems.append(
                f"spp: a sequential plan runs its stages 0->1->…->{len(plan.stages) - 1} in order; "
                f"edge {src}->{dst} {'is missing' if missing else 'goes backward'}"
            )
    return problems


def _memory_problems(plan: Any, graph: Any, devices: dict[str, Any]) -> list[str]:
    """Eq. 3.2 counted again from the model for every stage (see the module docstring)."""
    problems: list[str] = []
    training = plan.training
    # Which stages recompute is the planner's choice within what it was allowed.
    wrong = [str(st.id) for st in plan.stages if st.recompute != (training.recompute == "all")]
    if training.recompute != "auto" and wrong:
        given = "training" in plan.model_fields_set and "recompute" in training.model_fields_set
        verb = "keep" if training.recompute == "all" else "recompute"
        who = f"stages {', '.join(wrong)} {verb} their" if len(wrong) > 1 else f"stage {wrong[0]} {verb}s its"
        problems.append(
            f"memory: {who} activations, but training.recompute is {training.recompute!r}"
            + ("" if given else " (its default: the plan does not say)")
        )
    problems.extend(_zero_problems(plan))
    problems.extend(_tensor_parallel_problems(plan, devices))
    groups = [[n for n in st.nodes if n in graph.dag] for st in plan.stages]
    copies, owned = graph.shared_copies(groups), graph.shared_owned(groups)
    splits = {t: tensor_parallel(graph, t) for t in {st.tensor_parallel for st in plan.stages}}
    for st in plan.stages:
        types = {devices[d].type_name for d in st.devices}
        if len(types) > 1:
            problems.append(
                f"stage {st.id}: devices of types {', '.join(sorted(types))} (one type per stage)"
            )
            continue
        try:
            need = counted_memory(
                st,
                graph,
                devices[st.devices[0]].type,
                training,
                copies[st.id],
                owned[st.id],
                splits[st.tensor_parallel],
            )
        except ValueError as exc:  # bytes per parameter below weights + gradients
            return [f"training.bytes_per_param: {exc}"]
        capacity = min(devices[d].type.memory for d in st.devices)
        samples = per_device_samples(st.micro_batch_size, st.replicas)
        counted = (
            f"its operators need {need.peak} ({need.weights} weights, {need.optimizer} gradients and "
            f"optimizer state, {need.activations} activations of {st.in_flight} micro-batch(es) of "
            f"{samples} sample(s))"
        )
        if need.peak > capacity + _MEMORY_SLACK:
            problems.append(f"memory: stage {st.id}: {counted}; its devices have {capacity}")
        elif abs(st.memory.peak - need.peak) > _MEMORY_SLACK:
            # Either way: a record below the count hides memory; one above it is of another plan
            # (a stage's recompute flag edited, say), whose predicted times are not this one's.
            problems.append(f"memory: stage {st.id} records {st.memory.peak} bytes; {counted}")
    return problems


def _tensor_parallel_problems(plan: Any, devices: dict[str, Any]) -> list[str]:
    """A tensor-parallel replica's devices share a node (its all-reduces run on the node's link),
    and launch runs one degree per plan."""
    problems = []
    for st in plan.stages:
        t = st.tensor_parallel
        for q in range(st.replicas):
            nodes = {devices[d].node for d in st.devices[q * t : (q + 1) * t] if d in devices}
            if len(nodes) > 1:
                problems.append(
                    f"stage {st.id}: replica {q}'s {t} tensor-parallel devices are on nodes "
                    f"{', '.join(sorted(nodes))} (one node per replica)"
                )
    degrees = sorted({st.tensor_parallel for st in plan.stages})
    if len(degrees) > 1:
        problems.append(f"tensor_parallel: stages differ ({degrees}); launch runs one degree per plan")
    return problems


def _zero_problems(plan: Any) -> list[str]:
    """Which stages shard their optimizer state (ZeRO-1) is the planner's choice within what it was
    allowed; a stage of one replica has nothing to shard it over."""
    problems = []
    zero = plan.training.zero
    for st in plan.stages:
        if st.zero and st.replicas == 1:
            problems.append(f"stage {st.id}: zero 1 on one replica (ZeRO shards over data-parallel replicas)")
        elif zero != "auto" and st.zero != (zero == 1 and st.replicas > 1):
            problems.append(
                f"stage {st.id}: zero {st.zero}, but training.zero is {zero} "
                f"({'every replicated stage' if zero == 1 else 'no stage'} shards its optimizer state)"
            )
    return problems


def counted_memory(
    st: Any,
    graph: Any,
    device_type: Any,
    training: Any,
    copies: int = 0,
    owned: int = 0,
    split: TpSplit | None = None,
) -> StageMemoryEstimate:
    """Eq. 3.2 for one device of plan stage ``st`` (recomputing its activations where ``st.recompute``,
    its optimizer state sharded where ``st.zero``), counted from ``graph`` on ``device_type`` for
    ``training`` (a :class:`~tessera.core.plans.TrainingSetup`): what ``validate`` checks a plan's
    memory against. ``copies``: parameter elements of shared weights the stage holds without being
    charged for (:meth:`tessera.core.graph.Graph.shared_copies`); ``owned``: those it is charged
    for (:meth:`~tessera.core.graph.Graph.shared_owned`), whose optimizer state ZeRO keeps whole;
    ``split``: the whole graph's tensor-parallel split at the stage's degree, where the caller has it."""
    cost = CostModel.for_device(device_type, training.precision, training.bytes_per_param)
    nodes = [n for n in st.nodes if n in graph.dag]
    inside = set(nodes)
    weights, optimizer, activations = cost.memory_of(graph, nodes)
    memory = cost.memory
    state = optimizer - sum(cost.gradient_bytes(graph.op(n)) for n in nodes)
    state -= owned * memory.optimizer_state_bytes_per_param
    weights += copies * memory.weight_bytes_per_param
    optimizer += copies * (memory.gradient_bytes_per_param + memory.optimizer_state_bytes_per_param)
    t = getattr(st, "tensor_parallel", 1)
    if t > 1:  # each tensor-parallel rank keeps 1/t of the split weights and activations
        params, acts = tensor_parallel_share(graph, nodes, split or tensor_parallel(graph, t))
        kept = 1 - 1 / t
        weights -= params * memory.weight_bytes_per_param * kept
        optimizer -= (
            params * (memory.gradient_bytes_per_param + memory.optimizer_state_bytes_per_param) * kept
        )
        state -= params * memory.optimizer_state_bytes_per_param * kept
        activations -= acts * memory.activation_scale * kept
    optimizer = sharded_optimizer(optimizer, state, st.replicas, getattr(st, "zero", 0))
    entering: dict[str, int] = {}  # what a recomputing stage keeps: the tensors coming in
    if st.recompute:
        for v in inside:
            for u, _, data in graph.dag.in_edges(v, data=True):
                if u not in inside and u not in graph.constant_nodes:
                    entering.update((t.name, t.nbytes) for t in data["tensors"])
    return stage_memory(
        weights=weights,
        optimizer=optimizer,
        activation_per_sample=activations,
        input_per_sample=sum(cost.wire_bytes(b) for b in entering.values()),
        micro_batch=st.micro_batch_size,
        devices=st.replicas,
        in_flight=st.in_flight,
        recompute=st.recompute,
    )
