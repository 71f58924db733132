"""Cost model of one decode step under cache (CP), tensor (TP) and data (DP) parallelism.

Only attention grows with the KV cache (§4.3). TP splits every weight and all-reduces twice per layer;
DP replicates and straggles on unknown output lengths; CP splits the KV cache along the sequence for
attention and is DP elsewhere. Per device and step: a roofline of dense and attention compute,
collectives at the §4.4 volumes, and PagedAttention block-table overhead (§4.5). Weights plus KV
cache beyond device memory is infeasible.

References: thesis ch. 4, §4.2.3–4.5, Fig. 4.5. Derivation: docs/cp.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from tessera.core.specs import ClusterSpec, Device
from tessera.planners.cp.llm import LlmConfig
from tessera.planners.cp.workload import Workload, dp_replica_steps

__all__ = [
    "STRATEGIES",
    "Collective",
    "CostParams",
    "Estimate",
    "TpLaunch",
    "cp_comm_elements",
    "decode_op_overhead",
    "degrees",
    "dp_replica_steps",
    "estimate",
    "estimate_all",
    "tp_comm_elements",
]

Strategy = Literal["tp", "cp", "dp"]
STRATEGIES: tuple[Strategy, ...] = ("tp", "cp", "dp")


@dataclass(frozen=True)
class TpLaunch:
    """What tessera's launch runs on ``t`` tensor-parallel ranks (``GraphDecoder.shard``): the share
    of a layer's weights it keeps whole on every rank (where the dataflow split does not reach), the
    share of the attention cores it runs with every head (each rank attending with its share, the
    outputs gathered), and the all-reduces of partial sums a layer runs."""

    t: int
    whole: float = 0.0
    gathered: float = 0.0
    reduces: float = 2.0

    def to_json(self) -> dict[str, Any]:
        return {k: _sig(v) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class CostParams:
    """The cost model's constants that the cluster spec does not give. ``block_table_entry_s``:
    host time per block-table entry per decode step (thesis §4.5.2, §4.5.4); its default, 20 ns, is
    derived in docs/cp.md ("The cost model"). Every plan records them (``predicted.cost_model``)."""

    kv_block: int = 16
    """Tokens per paged KV-cache block (vLLM's default; also the kernels' shard alignment)."""
    block_table_entry_s: float = 20e-9
    kernels_per_layer: int = 12
    """GPU kernels per layer and step: 2 norms, Q/K/V, attention, output projection, 2 residual
    adds, FFN (up, activation, down) and a rotary/bias op; CP adds one merge kernel. Used where
    ``step_operations`` is not known."""
    step_operations: int = 0
    """The operations one decode step of the whole model runs, counted from the step program the
    executor traces of the plan's ONNX model (``plan`` counts them; 0: ``kernels_per_layer`` a
    layer). Each is charged the device's ``decode_op_overhead``."""
    compiled: bool = False
    """The step runs compiled by torch.compile (``launch --compile``): each operation is charged the
    device's ``decode_compiled_op_overhead`` instead (``decode_op_overhead`` where it has none)."""
    measured_op_overhead: tuple[float, float] = (0.0, 0.0)
    """(traced, compiled): seconds an operation of this model's own decode step, measured on this
    machine by ``plan --profile`` (its step less the modeled compute, over ``step_operations``), in
    place of the device's ``decode_op_overhead`` and ``decode_compiled_op_overhead`` (0: the device's)."""
    gather_operations: tuple[int, int] = (0, 0)
    """(tp, cp): the operations, in the same units, a tp or a cp rank's attention adds a layer to a
    dp rank's in tessera's launch (cp: the partial's log-sum-exp column and the merge; both: the
    gather's copies in and out), charged to the ``launch`` step of the estimate."""
    reduce_operations: int = 0
    """The operations, in the same units, each all-reduce of a tp rank's partial sums adds in
    tessera's launch (the exchange's copies in and out, the sum)."""
    tp_launch: tuple[TpLaunch, ...] = ()
    """What tessera's launch splits at each tp degree (the model's dataflow split); a degree not
    listed is split as the thesis's tp (tessera's own GPT)."""
    dp_trials: int = 2048
    """Monte Carlo draws of the output lengths for the DP straggler (seeded, so deterministic)."""
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "kv_block": self.kv_block,
            "block_table_entry_s": self.block_table_entry_s,
            "kernels_per_layer": self.kernels_per_layer,
            **({"step_operations": self.step_operations} if self.step_operations else {}),
            **({"compiled": True} if self.compiled else {}),
            **(
                {"measured_op_overhead": [_sig(x) for x in self.measured_op_overhead]}
                if any(self.measured_op_overhead)
                else {}
            ),
            **({"gather_operations": list(self.gather_operations)} if any(self.gather_operations) else {}),
            **({"reduce_operations": self.reduce_operations} if self.reduce_operations else {}),
            **({"tp_launch": [t.to_json() for t in self.tp_launch]} if self.tp_launch else {}),
            "dp_trials": self.dp_trials,
            "seed": self.seed,
        }


# -- communication volume: thesis §4.4 -----------------------------------------------------------


def cp_comm_elements(
    n: int, batch: int, hidden: int, heads: int, *, kv_dim: int | None = None
) -> tuple[float, float]:
    """Per-GPU, per-layer communication volume of CP in elements: ``(all-gather, all-to-all)``.

    Thesis §4.4, "Communication" (volumes in elements: it assumes 1 byte per datum)::

        (all-gather) + (all-to-all) = (N-1)·3BE/N + (N-1)·B(E+2H)/2

    The all-gather brings every device the Q, K and V of all ``B`` requests (``3E`` per request for
    multi-head attention; ``E + 2·kv_dim`` with grouped-query attention, which equals ``3E`` when
    ``kv_dim = E``). The all-to-all returns to each request's device its partial results from every
    shard: the output ``o`` (``E``) and the softmax max ``m`` and sum ``s`` (``H`` each). The second
    term's divisor is the thesis's ``2``, as printed (not ``N``; the two agree at ``N = 2``).
    """
    qkv = 3 * hidden if kv_dim is None else hidden + 2 * kv_dim
    all_gather = (n - 1) * batch * qkv / n
    all_to_all = (n - 1) * batch * (hidden + 2 * heads) / 2
    return all_gather, all_to_all


def tp_comm_elements(n: int, batch: int, hidden: int) -> float:
    """Per-GPU, per-layer communication volume of TP in elements: thesis §4.4, ``(2 all-reduce) = 4(N-1)BE``.

    Each all-reduce (after the attention output projection and after the FFN) moves ``2(N-1)BE``:
    every device sends its ``B×E`` partial sum to the ``N-1`` others and receives theirs.
    """
    return 4 * (n - 1) * batch * hidden


# -- the estimate -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One collective of a layer's schedule: what it moves, per GPU, over which devices."""

    op: Literal["all_gather", "all_to_all", "all_reduce"]
    bytes: int
    group: tuple[str, ...]
    what: str
    time_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "bytes": self.bytes,
            "group": list(self.group),
            "what": self.what,
            "time_s": _sig(self.time_s),
        }


@dataclass(frozen=True)
class Estimate:
    """The predicted decode step of one strategy at one degree."""

    strategy: Strategy
    degree: int
    devices: tuple[str, ...]
    feasible: bool
    reason: str | None
    step_time_s: float
    tokens_per_s: float
    compute_s: float
    communication_s: float
    host_s: float
    weights_bytes: int
    kv_cache_bytes: int
    capacity_bytes: int
    collectives: tuple[Collective, ...] = ()
    kv_split: str = ""
    expert_split: str = ""  # how a mixture of experts' experts are held; "" for a dense FFN
    dp_straggler: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)
    launch: dict[str, Any] = field(default_factory=dict)
    """tp and cp on more than one device: the step as tessera's own ``launch`` runs it, the dense
    part replicated on every rank and one gather of the attention outputs a layer (empty: the same
    as the estimate)."""

    @property
    def memory_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes

    @property
    def per_token_latency_s(self) -> float:
        """Time between two tokens of one request: one decode step."""
        return self.step_time_s

    @property
    def label(self) -> str:
        return f"{self.strategy}-{self.degree}"

    def summary(self) -> dict[str, Any]:
        """The estimate as plain data (a plan's ``predicted`` or one of its ``alternatives``)."""
        return {
            "strategy": self.strategy,
            "degree": self.degree,
            "feasible": self.feasible,
            "reason": self.reason,
            "tokens_per_s": _sig(self.tokens_per_s) if self.feasible else None,
            "per_token_latency_s": _sig(self.per_token_latency_s) if self.feasible else None,
            "step_time_s": _sig(self.step_time_s),
            "breakdown": {
                "compute_s": _sig(self.compute_s),
                "communication_s": _sig(self.communication_s),
                "host_s": _sig(self.host_s),
            },
            "memory_per_device": {
                "weights": self.weights_bytes,
                "kv_cache": self.kv_cache_bytes,
                "total": self.memory_bytes,
                "capacity": self.capacity_bytes,
            },
            "dp_straggler": _sig(self.dp_straggler),
            **({"launch": self.launch} if self.launch else {}),
        }


def degrees(num_devices: int) -> list[int]:
    """The parallel degrees a cluster offers: the divisors of its device count (1, 2, 4, … for 8)."""
    return [d for d in range(1, num_devices + 1) if num_devices % d == 0]


def estimate_all(
    llm: LlmConfig,
    cluster: ClusterSpec,
    workload: Workload,
    *,
    layers: int | None = None,
    params: CostParams | None = None,
) -> list[Estimate]:
    """Every strategy at every degree (:func:`degrees`), in (strategy, degree) order."""
    return [
        estimate(llm, cluster, workload, strategy, n, layers=layers, params=params)
        for strategy in STRATEGIES
        for n in degrees(cluster.num_devices)
    ]


def estimate(
    llm: LlmConfig,
    cluster: ClusterSpec,
    workload: Workload,
    strategy: Strategy,
    degree: int,
    *,
    layers: int | None = None,
    params: CostParams | None = None,
) -> Estimate:
    """Predict one decode step of ``strategy`` on the first ``degree`` devices of ``cluster``.

    ``layers`` evaluates only that many transformer layers and no embedding or LM head (the thesis
    measures a single layer, §4.5.1, reporting tokens/s per layer); the default is the whole model.
    """
    p = params or CostParams()
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if degree < 1 or degree > cluster.num_devices:
        raise ValueError(f"degree {degree} is not in 1..{cluster.num_devices}")
    group = cluster.devices()[:degree]
    n = degree
    num_layers = llm.layers if layers is None else layers
    with_head = layers is None
    b = llm.dtype_bytes
    batch = workload.batch
    blk = p.kv_block
    kv_token_layer = 2 * llm.kv_dim * b  # bytes one token adds to one layer's KV cache

    # Weights: per layer, plus the embedding (held) and the LM head (read every step).
    layer_weight_bytes = llm.layer_params * b
    head_read_bytes = llm.vocab * llm.hidden * b if with_head else 0
    embedding_bytes = llm.embedding_params * b if with_head else 0
    dense_flops_per_token = 2 * (llm.attention_params + llm.active_ffn_params)
    attn_flops_per_position = 4 * llm.heads * int(llm.head_dim)  # Q·Kᵀ and ·V, per token and position

    kernels = p.kernels_per_layer + (1 if strategy == "cp" and n > 1 else 0)  # cp: the log-sum-exp merge
    at = _Layout.of(strategy, llm, workload, n, blk)
    reasons = list(at.reasons)
    weights = (num_layers * layer_weight_bytes + embedding_bytes) * at.weight_share
    kv_cache = at.kv_requests * at.kv_positions * kv_token_layer * num_layers * at.kv_share
    collectives = _collectives(strategy, llm, cluster, group, batch, b)

    # Per device: the slowest device of the group sets the step.
    def step_parts(
        device: Device, tokens: int, share: float = at.weight_share, head_share: float | None = None
    ) -> tuple[float, float]:
        peak = device.type.peak_flops(llm.dtype)
        bw = device.type.memory_bandwidth
        dense = max(
            tokens * dense_flops_per_token * share / peak,
            llm.layer_read_params(tokens) * b * share / bw,
        )
        head_share = share if head_share is None else head_share  # the LM head's (tessera's tp: whole)
        requests = at.attn_requests if strategy != "dp" else tokens
        attention = max(
            requests * at.attn_positions * attn_flops_per_position * at.attn_share / peak,
            requests * at.attn_positions * kv_token_layer * at.attn_share / bw,
        )
        head = 0.0
        if with_head:
            head = max(
                tokens * 2 * llm.vocab * llm.hidden * head_share / peak,
                head_read_bytes * head_share / bw,
            )
        compute = num_layers * (dense + attention) + head
        if p.step_operations:  # the executor's own count, the layers' share of it per layer
            op = p.measured_op_overhead[p.compiled] or decode_op_overhead(device, compiled=p.compiled)
            return compute, p.step_operations * num_layers / llm.layers * op
        launches = (num_layers * kernels + (1 if with_head else 0)) * device.type.kernel_launch_overhead
        return compute, launches

    def step_time(tokens: int) -> tuple[float, float, float, float]:
        worst = max(step_parts(d, tokens) for d in group)
        compute, launches = worst
        entries = at.table_entries if strategy != "dp" else tokens * math.ceil(workload.mean_kv_length / blk)
        host = launches + entries * p.block_table_entry_s
        comm = num_layers * sum(c.time_s for c in collectives)
        return compute + host + comm, compute, comm, host

    step, compute, comm, host = step_time(at.dense_tokens)
    launch: dict[str, Any] = {}
    if strategy != "dp" and n > 1:  # what tessera's own launch runs (docs/executor.md)
        split = TpLaunch(n, whole=1.0, gathered=1.0, reduces=0.0)  # cp: the dense part on every rank
        if strategy == "tp":
            split = next((t for t in p.tp_launch if t.t == n), TpLaunch(n))
        share = split.whole + (1 - split.whole) / n
        ran = max(step_parts(d, batch, share=share, head_share=1.0) for d in group)
        gather = _launch_gather(strategy, llm, cluster, group, batch)
        reduce = _launch_exchange(
            cluster, group, (n - 1) * batch * llm.hidden * 4, "partial sums, fp32 (all-reduce)"
        )
        launch_comm = num_layers * (split.gathered * gather.time_s + split.reduces * reduce.time_s)
        added = num_layers * (
            split.gathered * p.gather_operations[STRATEGIES.index(strategy)]
            + split.reduces * p.reduce_operations
        )
        launch_host = ran[1] + at.table_entries * p.block_table_entry_s
        if p.step_operations and added:  # the callbacks run eager, compiled step or not
            eager = p.measured_op_overhead[0] or max(decode_op_overhead(d, compiled=False) for d in group)
            launch_host += added * eager
        ran_collectives = [
            {**c.to_json(), "per": f"{k:.3g} a layer"}
            for c, k in ((gather, split.gathered), (reduce, split.reduces))
            if k
        ]
        skew = group[0].type.decode_rank_skew if len({d.node_index for d in group}) == 1 else 0.0
        launch = {  # ranks exchanging every layer run at the slowest one's pace (decode_rank_skew)
            "step_time_s": _sig((ran[0] + launch_host) * (1 + skew) + launch_comm),
            "compute_s": _sig(ran[0]),
            "communication_s": _sig(launch_comm),
            "host_s": _sig(launch_host),
            "collectives": ran_collectives,
            **({"weights_whole": _sig(split.whole)} if strategy == "tp" else {}),
        }
    straggler = 1.0
    if strategy == "dp" and batch >= n:
        # Replicas finish their own requests' work (Σ output lengths / slots) at different times.
        counts = np.bincount(np.arange(batch) % n, minlength=n)
        steps = dp_replica_steps(workload.output, batch, n, trials=p.dp_trials, seed=p.seed)
        times = np.array([step_time(int(c))[0] for c in counts])
        makespan = float(np.mean(np.max(steps * times, axis=1)))
        generated = float(np.mean(np.sum(steps * counts, axis=1)))
        tokens_per_s = generated / makespan
        straggler = float(np.mean(np.max(steps, axis=1)) / np.mean(steps))
    else:
        tokens_per_s = batch / step

    capacity = min(d.type.memory for d in group)
    weights_bytes, kv_bytes = math.ceil(weights), math.ceil(kv_cache)
    if weights_bytes + kv_bytes > capacity:
        reasons.append(
            f"needs {_gib(weights_bytes + kv_bytes)} per device (weights {_gib(weights_bytes)}, "
            f"KV cache {_gib(kv_bytes)}), devices have {_gib(capacity)}"
        )
    return Estimate(
        strategy=strategy,
        degree=n,
        devices=tuple(d.id for d in group),
        feasible=not reasons,
        reason="; ".join(reasons) or None,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        compute_s=compute,
        communication_s=comm,
        host_s=host,
        weights_bytes=weights_bytes,
        kv_cache_bytes=kv_bytes,
        capacity_bytes=capacity,
        collectives=tuple(collectives),
        kv_split=at.kv_split,
        expert_split=_expert_split(llm, strategy, n, at.dense_tokens),
        dp_straggler=straggler,
        launch=launch,
    )


def _launch_gather(
    strategy: str, llm: LlmConfig, cluster: ClusterSpec, group: list[Device], batch: int
) -> Collective:
    """The collective a gathered core of tessera's launch runs on tp and cp ranks: every rank's
    attention output gathered, in fp32 (tp, a core the split does not reach: its share of the heads;
    cp: every head's partial and its log-sum-exp); each rank receives the others' ``n − 1`` parts."""
    n, head_dim = len(group), int(llm.head_dim)
    part = batch * (llm.heads // n * head_dim if strategy == "tp" else llm.heads * (head_dim + 1)) * 4
    what = (
        "attention outputs of the rank's heads" if strategy == "tp" else "partial attention o and log-sum-exp"
    )
    return _launch_exchange(cluster, group, (n - 1) * part, what)


def _launch_exchange(cluster: ClusterSpec, group: list[Device], nbytes: float, what: str) -> Collective:
    """An all-gather of tessera's decode launch: through shared memory where the group shares a
    host and the spec measured that exchange (``decode_exchange_overhead``), else over the link."""
    c = _collective(cluster, group, "all_gather", nbytes, what)
    kind = group[0].type
    if kind.decode_exchange_overhead is None or len({d.node_index for d in group}) > 1:
        return c
    return replace(c, time_s=kind.decode_exchange_overhead + c.bytes / kind.memory_bandwidth)


def _expert_split(llm: LlmConfig, strategy: str, n: int, tokens: int) -> str:
    """Where the experts of a mixture live, and what a step reads of them."""
    if llm.experts == 1:
        return ""
    held = (
        f"each device holds 1/{n} of every expert's matrices (experts split like the dense layers)"
        if strategy == "tp" and n > 1
        else f"every device holds all {llm.experts} experts"
    )
    return (
        f"{held}; a step of {tokens} token(s) per device reads {llm.experts_read(tokens):.3g} of {llm.experts} experts "
        f"({llm.experts_per_token} per token, routing assumed uniform)"
    )


@dataclass(frozen=True)
class _Layout:
    """What one device of a strategy holds and computes per decode step (thesis §4.2-4.4)."""

    dense_tokens: int  # tokens through the dense layers
    attn_requests: int  # requests attended, each over
    attn_positions: float  # this many positions,
    attn_share: float  # for this share of the heads
    table_entries: float  # PagedAttention block-table entries kept
    weight_share: float  # of every weight matrix (and the LM head)
    kv_requests: int  # the KV cache held: requests x positions x share of the KV heads
    kv_positions: int
    kv_share: float
    kv_split: str
    reasons: tuple[str, ...] = ()

    @staticmethod
    def of(strategy: str, llm: LlmConfig, workload: Workload, n: int, blk: int) -> _Layout:
        batch, mean_kv, max_kv = workload.batch, workload.mean_kv_length, workload.max_kv_length
        mean_blocks = math.ceil(mean_kv / blk)
        if strategy == "tp":
            kv_heads = int(llm.kv_heads)
            why = ()
            if llm.heads % n or (kv_heads % n and n % kv_heads):
                why = (
                    f"tensor parallelism needs the heads ({llm.heads}) to be a multiple of the degree {n}, and "
                    f"the KV heads ({kv_heads}) a multiple or a divisor of it (thesis §4.2.3)",
                )
            # Fewer KV heads than devices: each device keeps its query heads' KV head whole (replicated).
            return _Layout(
                batch, batch, mean_kv, 1 / n, batch * mean_blocks, 1 / n, batch, max_kv, max(1 / n, 1 / kv_heads),
                "heads: every device holds all positions of every request for heads/N heads", why,
            )  # fmt: skip
        if strategy == "dp":
            why = (f"data parallelism over {n} replicas needs at least {n} requests (batch {batch})",)
            per_replica = math.ceil(batch / n)
            return _Layout(
                per_replica, per_replica, mean_kv, 1.0, per_replica * mean_blocks, 1.0, per_replica, max_kv, 1.0,
                "requests: each replica holds the whole KV cache of its own requests", why if batch < n else (),
            )  # fmt: skip
        # cp: every device attends all B requests to its shard, the largest block-aligned one
        shard_blocks = math.ceil(mean_blocks / n)
        max_shard = min(max_kv, math.ceil(math.ceil(max_kv / blk) / n) * blk)
        return _Layout(
            math.ceil(batch / n), batch, min(mean_kv, shard_blocks * blk), 1.0, batch * shard_blocks, 1.0,
            batch, max_shard, 1.0, "sequence: each device holds a block-aligned range of every request's positions",
        )  # fmt: skip


def _collectives(
    strategy: str, llm: LlmConfig, cluster: ClusterSpec, group: list[Device], batch: int, b: float
) -> list[Collective]:
    """A layer's collectives: tp's two all-reduces, cp's all-gather and all-to-all (§4.4)."""
    if len(group) == 1 or strategy == "dp":
        return []
    n = len(group)
    if strategy == "tp":
        volume = tp_comm_elements(n, batch, llm.hidden) * b / 2  # per all-reduce
        return [
            _collective(cluster, group, "all_reduce", volume, what)
            for what in ("attention output projection partial sums", "FFN output partial sums")
        ]
    gather, exchange = cp_comm_elements(n, batch, llm.q_dim, llm.heads, kv_dim=llm.kv_dim)
    return [
        _collective(cluster, group, "all_gather", gather * b, "q, k, v of every request"),
        _collective(
            cluster, group, "all_to_all", exchange * b, "partial attention o, m, s to each request's device"
        ),
    ]


def decode_op_overhead(device: Device, *, compiled: bool = False) -> float:
    """Host seconds per operation of ``device``'s decode step: the compiled step's where ``compiled``
    and the spec has it, else the traced step's, else the kernel launch overhead."""
    t = device.type
    return (compiled and t.decode_compiled_op_overhead) or t.decode_op_overhead or t.kernel_launch_overhead


def _collective(
    cluster: ClusterSpec,
    group: list[Device],
    op: Literal["all_gather", "all_to_all", "all_reduce"],
    nbytes: float,
    what: str,
) -> Collective:
    """A collective over ``group``: ``steps · latency + bytes / bandwidth`` on its slowest link.

    ``steps`` is ``N-1`` for an all-gather or all-to-all and ``2(N-1)`` for an all-reduce (ring
    algorithms); ``bytes`` is the per-GPU volume of thesis §4.4.
    """
    n = len(group)
    # The links a pair of the group's devices takes: intra-node where a node holds two of them,
    # inter-node where they span two nodes (one pair of each kind, not all N² pairs).
    first_on: dict[int, Device] = {}
    pairs: list[tuple[Device, Device]] = []
    for device in group:
        first = first_on.setdefault(device.node_index, device)
        if first is not device and not pairs:
            pairs.append((first, device))
    if len(first_on) > 1:
        pairs.append(tuple(list(first_on.values())[:2]))  # type: ignore[arg-type]
    links = [cluster.link_between(a, b) for a, b in pairs]
    bandwidth = min(link.bandwidth for link in links)
    latency = max(link.latency for link in links)
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    nbytes_int = math.ceil(nbytes)
    return Collective(
        op=op,
        bytes=nbytes_int,
        group=tuple(d.id for d in group),
        what=what,
        time_s=steps * latency + nbytes_int / bandwidth,
    )


def _sig(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits (stable, readable plan JSON)."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
