"""GPP vs sequential pipelines on GraphPipe's benchmark models (thesis §3.7, §3.10.3).

MMT, DLRM and CANDLE-Uno at paper size on the ``graphpipe-v100`` cluster (4 V100 per node; for
32 devices the preset is extended to 8 nodes), mini-batch sizes of thesis §3.10.3. For each
configuration: simulated throughput of the GPP plan, of the PipeDream-style SPP plan, search
times, pipeline depths, and the size of Piper's search space (ideals of the coarsened DAG).

    .venv/bin/python bench/gpp.py            # writes bench/results/gpp.md
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tessera.core.cost import CostModel
from tessera.core.files import write_atomic
from tessera.core.graph import Graph, load_graph
from tessera.core.rewrite import REWRITES
from tessera.core.specs import ClusterSpec, load_cluster
from tessera.models import build
from tessera.planners.pipeline.piper import MIN_UNIT_SHARE, PIPER_LIMIT, piper_ideals, plan_piper
from tessera.planners.pipeline.plan import plan_gpp
from tessera.planners.pipeline.search import build_tree, partition
from tessera.planners.pipeline.spp import plan_spp
from tessera.planners.pipeline.types import PartitionOptions
from tessera.planners.sim import simulate_pipeline

MINI_BATCH = {
    "mmt": {4: 64, 8: 128, 16: 256, 32: 512},
    "dlrm": {4: 256, 8: 512, 16: 1024, 32: 2048},
    "candle_uno": {4: 4096, 8: 8192, 16: 16384, 32: 32768},
}


SHARED_COUNTS = (8, 16, 32)  # multi-node configurations rerun with network interfaces (links.nics)


def cluster_with(devices: int, nics: str | None = None) -> ClusterSpec:
    """The preset, extended to enough 4-GPU nodes; ``nics``: the spec's ``links.nics``."""
    base = load_cluster("graphpipe-v100")
    if devices <= base.num_devices and nics is None:
        return base
    data = base.to_json_dict()
    data["nodes"] = [{**data["nodes"][0], "count": max(data["nodes"][0]["count"], -(-devices // 4))}]
    if nics is not None:
        data["links"]["nics"] = nics
    return ClusterSpec.from_json_dict(data)


def gpp_vs_sequential(graph: Graph, cluster: ClusterSpec, opts: PartitionOptions, *, timed: bool) -> dict:
    """``tessera plan --kind gpp``'s plan and the sequential baseline it records (the faster of
    the PipeDream- and Piper-style plans): throughputs, the baseline's planner, the GPP plan's
    structure, depth and schedule, and, when ``timed``, the GPP search alone (``partition`` on a
    series-parallel tree built beforehand, as the first table times it)."""
    row: dict = {}
    if timed:
        tree = build_tree(graph, CostModel.for_device(cluster.devices()[0].type), opts.max_units)
        t0 = time.perf_counter()
        partition(graph, cluster, opts, tree=tree)
        row["t_gpp"] = time.perf_counter() - t0
    plan, pipe, sim = plan_gpp(graph, cluster, opts)
    base = plan.baseline or {}
    row.update(
        gpp=sim.throughput,
        seq=base["throughput_samples_per_s"],
        method="Piper" if base["method"].startswith("Piper") else "PipeDream",
        structure=plan.predicted["structure"],
        depth=pipe.pipeline_depth,
        schedule=pipe.schedule_kind,
    )
    return row


def nic_rows(counts: list[int], own: list[dict], nics: str) -> list[dict]:
    """GPP and its sequential baseline (the faster of the PipeDream- and Piper-style plans, as
    the plan records it) with network interfaces (``links.nics``: ``per-node``, the node's one
    interface shared; ``per-device``, one per GPU; a FIFO per direction) instead of a link per
    stage pair, next to the own-link throughput of ``own``."""
    rows = []
    for name, sizes in MINI_BATCH.items():
        graph = load_graph(build(name, "paper"))
        for d in (c for c in counts if c in SHARED_COUNTS):
            cluster = cluster_with(d, nics)
            opts = PartitionOptions(mini_batch=sizes[d], num_devices=d)
            row = gpp_vs_sequential(graph, cluster, opts, timed=False)
            row.update(
                model=name, devices=d, own=next(r for r in own if r["model"] == name and r["devices"] == d)
            )
            rows.append(row)
            print(
                f"{name:10} {d:>2} {nics} NICs: gpp {row['gpp']:10.1f} best sequential {row['seq']:10.1f} "
                f"({row['method']}) x{row['gpp'] / row['seq']:.2f}",
                flush=True,
            )
    return rows


def main() -> None:
    counts = [int(a) for a in sys.argv[1:]] or [4, 8, 16, 32]
    rows = []
    for name, sizes in MINI_BATCH.items():
        graph = load_graph(build(name, "paper"))
        for d in counts:
            cluster = cluster_with(d)
            opts = PartitionOptions(mini_batch=sizes[d], num_devices=d)
            cost = CostModel.for_device(cluster.devices()[0].type)
            tree = build_tree(graph, cost, opts.max_units)
            t0 = time.perf_counter()
            gpp_dp = partition(graph, cluster, opts, tree=tree)
            t_gpp = time.perf_counter() - t0
            t0 = time.perf_counter()
            spp = plan_spp(graph, cluster, opts, tree=tree)
            t_spp = time.perf_counter() - t0
            piper = plan_piper(graph, cluster, opts, tree=tree)
            plan, pipe, sim = plan_gpp(graph, cluster, opts)
            ideals = piper_ideals(tree)
            rows.append(
                {
                    "model": name,
                    "devices": d,
                    "mini_batch": sizes[d],
                    "gpp": sim.throughput,
                    "spp": simulate_pipeline(spp).throughput,
                    "piper": simulate_pipeline(piper.pipeline).throughput if piper.pipeline else None,
                    "piper_depth": piper.pipeline.pipeline_depth if piper.pipeline else None,
                    "piper_units": piper.units if piper.pipeline else None,
                    "t_piper": piper.search_time_s,
                    "piper_reason": piper.reason,
                    "gpp_depth": pipe.pipeline_depth,
                    "gpp_stages": len(pipe.stages),
                    "used": sum(len(st.devices) for st in pipe.stages),
                    "spp_depth": spp.pipeline_depth,
                    "structure": plan.predicted["structure"],
                    "dp_depth": gpp_dp.pipeline_depth,
                    "t_gpp": t_gpp,
                    "t_spp": t_spp,
                    "units": tree.num_units,
                    "ideals": ideals,
                    "mb": pipe.micro_batch_size,
                }
            )
            r = rows[-1]
            print(
                f"{name:10} {d:>2} B={sizes[d]:>5} gpp {r['gpp']:10.1f} spp {r['spp']:10.1f} "
                f"x{r['gpp'] / max(r['spp'], 1e-9):.2f} depth {r['gpp_depth']}/{r['spp_depth']} "
                f"({r['structure']}) search {t_gpp:.2f}s/{t_spp:.2f}s "
                f"piper {_piper_cell(r)} ({r['t_piper']:.2f}s)",
                flush=True,
            )
    lines = [
        "# GPP vs sequential pipelines (predicted, simulator)",
        "",
        "Generated by `bench/gpp.py`: paper-size models, `graphpipe-v100` cluster (V100-16GB, 4 per node,",
        "NVLink 50 GB/s, IB 12.5 GB/s; 32 devices = the preset extended to 8 nodes), mini-batch sizes of",
        "thesis §3.10.3, Adam mixed precision (16 B/param), roofline cost model, 1F1B (every planner",
        "tunes each stage's warm-up on the simulator for its fastest candidates). Throughput is the",
        "discrete-event simulator's samples/s for one iteration. *GPP* is `tessera plan --kind gpp`",
        "(series-parallel DP of Algorithm 2, or the strongest sequential plan, PipeDream- or",
        "Piper-style, when that simulates faster: *structure*); *used* is the devices the GPP plan",
        "gives stages (a stage gets devices only where they make it faster). *SPP* is the",
        "PipeDream-style sequential planner on the same units and cost model (the faster of its chain",
        "DP's and its series-parallel-guided DP's proposals); its stages run in order",
        "(a chain: depth = stages). *Piper* is the Piper-style sequential planner",
        "(`tessera.planners.pipeline.piper`: a DP over the ideals of the unit DAG, a stage may span branches) on",
        f"the same cost model; it runs on at most {PIPER_LIMIT:,} ideals, coarsening the units (to at",
        f"least {MIN_UNIT_SHARE:.0%} of them, column *Piper units*) to get there, else it reports the",
        "configuration intractable (*Piper ideals*: those of the *units* column). Search times on this",
        "machine (2 cores, shared): GPP DP, SPP DP, Piper DP.",
        "",
        "| model | devices | used | mini-batch | GPP samples/s | SPP samples/s | Piper samples/s | GPP/SPP | GPP/Piper | depth GPP/SPP/Piper | stages | structure | micro-batch | search GPP s | search SPP s | search Piper s | units | Piper units | Piper ideals |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio = r["gpp"] / r["spp"] if r["spp"] else float("nan")
        vs_piper = f"{r['gpp'] / r['piper']:.2f}x" if r["piper"] else "—"
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['used']} | {r['mini_batch']} | {r['gpp']:.1f} | {r['spp']:.1f} | "
            f"{_piper_cell(r)} | {ratio:.2f}x | {vs_piper} | "
            f"{r['gpp_depth']}/{r['spp_depth']}/{r['piper_depth'] or '—'} | {r['gpp_stages']} | {r['structure']} | {r['mb']} | "
            f"{r['t_gpp']:.2f} | {r['t_spp']:.2f} | {r['t_piper']:.2f} | {r['units']} | {r['piper_units'] or '—'} | {r['ideals']:.3g} |"
        )
    shared = nic_rows(counts, rows, "per-node")
    if shared:
        lines += [
            "",
            "## With the node's network interface shared",
            "",
            "The table above gives every pair of communicating stages an inter-node link of its own",
            "(the cluster spec's `links.nics` unset). Summit's GPUs share their node's interface, so",
            "the multi-node configurations are rerun with `links.nics: per-node`: every transfer",
            "between nodes queues at the sending node's and the receiving node's interface (12.5 GB/s",
            "each direction, first come, first served), and a data-parallel stage over several nodes",
            "holds their interfaces while its all-reduce runs. Same planners; the partitioners' DPs",
            "do not model the contention, the simulator that ranks their candidates does.",
            "",
            *_nic_table(shared, "shared"),
        ]
    per_device = nic_rows(counts, rows, "per-device")
    if per_device:
        lines += [
            "",
            "## With a network interface per GPU",
            "",
            "`links.nics: per-device`, as in DGX-style nodes with a NIC per GPU (12.5 GB/s each):",
            "transfers queue at the sending and the receiving replica's interface, and a",
            "data-parallel stage over several nodes runs its ring through all of its replicas'",
            "interfaces at once (`partition.ring_link`: 4 × 12.5 GB/s, capped by NVLink's 50 GB/s,",
            "where the per-node table's ring has 12.5 GB/s). Not Summit's network: the same planners",
            "on a cluster where data parallelism across nodes is cheap.",
            "",
            *_nic_table(per_device, "per-GPU"),
        ]
    auto = auto_rows(counts, rows)
    lines += [
        "",
        "## With `--schedule auto`",
        "",
        "Own links, as in the first table; every planner (GPP, PipeDream- and Piper-style) searches",
        "as for 1F1B, then reschedules the candidates of that search by Algorithm 4 (the greedy",
        "scheduler, thesis §3.10.1), best first, within a budget of simulated passes (0.2–0.25 s here), and keeps the",
        "fastest plan that fits memory. *schedule*: what the GPP plan runs; *best sequential*: the",
        "faster sequential plan, also rescheduled where that helps. GPP search: `partition` with",
        "`auto`, on this machine.",
        "",
        "| model | devices | GPP samples/s | schedule | structure | best sequential samples/s | sequential planner | GPP/sequential | GPP 1F1B samples/s | auto/1F1B | search GPP s |",
        "| --- | ---: | ---: | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in auto:
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['gpp']:.1f} | {r['schedule']} | {r['structure']} | "
            f"{r['seq']:.1f} | {r['method']} | {r['gpp'] / r['seq']:.2f}x | {r['own']['gpp']:.1f} | "
            f"{r['gpp'] / r['own']['gpp']:.2f} | {r['t_gpp']:.2f} |"
        )
    rewritten = rewrite_rows(counts, rows, auto)
    lines += [
        "",
        "## With `--rewrite all` (reduce-concat, concat-matmul)",
        "",
        "Every planner on the model rewritten by two of TASO's substitutions (`tessera.core.rewrite`;",
        "thesis-jia-taso-flexflow Table 2.2). *concat-matmul*: the layer that reads the concatenated",
        "branch outputs (CANDLE-Uno: 7·4096 → 4096; DLRM: the dense and sparse features → 4096;",
        "MMT: the head) becomes one product per branch and a `Sum`, so a graph pipeline runs the",
        "parts inside the branches. *reduce-concat*: MMT's pooling over the sequence moves above",
        "its `Concat`, which lets concat-matmul split the head (it changes nothing in the others).",
        "The same planners as above, 1F1B and `--schedule auto`; *as given*: the first and fourth",
        "tables' GPP on the model as given; *best sequential*: the faster of the PipeDream- and",
        "Piper-style plans of the rewritten model (also rescheduled under `auto`). GPP search:",
        "`partition`, on this machine.",
        "",
        "| model | devices | schedule | GPP samples/s | GPP as given | rewritten/as given | best sequential samples/s | sequential planner | GPP/sequential | structure | depth | search GPP s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: |",
    ]
    for r in rewritten:
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['schedule']} | {r['gpp']:.1f} | {r['before']:.1f} | "
            f"{r['gpp'] / r['before']:.2f} | {r['seq']:.1f} | {r['method']} | {r['gpp'] / r['seq']:.2f}x | "
            f"{r['structure']} | {r['depth']} | {r['t_gpp']:.2f} |"
        )
    out = Path(__file__).parent / "results" / "gpp.md"
    write_atomic(out, "\n".join(lines) + "\n")
    print(f"wrote {out}")


def auto_rows(counts: list[int], own: list[dict]) -> list[dict]:
    """GPP and its sequential baseline with ``--schedule auto`` (each planner's 1F1B candidates,
    rescheduled by Algorithm 4 where that is faster), own links, next to the 1F1B rows ``own``."""
    rows = []
    for name, sizes in MINI_BATCH.items():
        graph = load_graph(build(name, "paper"))
        for d in counts:
            cluster = cluster_with(d)
            opts = PartitionOptions(mini_batch=sizes[d], num_devices=d, schedule="auto")
            row = gpp_vs_sequential(graph, cluster, opts, timed=True)
            row.update(
                model=name, devices=d, own=next(r for r in own if r["model"] == name and r["devices"] == d)
            )
            rows.append(row)
            print(
                f"{name:10} {d:>2} auto: gpp {row['gpp']:10.1f} ({row['schedule']}) best sequential "
                f"{row['seq']:10.1f} x{row['gpp'] / row['seq']:.2f} search {row['t_gpp']:.2f}s",
                flush=True,
            )
    return rows


def rewrite_rows(counts: list[int], own: list[dict], auto: list[dict]) -> list[dict]:
    """GPP and its sequential baseline on the models rewritten by ``reduce-concat`` and
    ``concat-matmul``, under 1F1B and ``--schedule auto``, next to the GPP of the model as given
    (``own``, ``auto``)."""
    rows = []
    for name in MINI_BATCH:
        graph = load_graph(build(name, "paper"), rewrites=list(REWRITES))
        for d in counts:
            for schedule, before in (("1f1b", own), ("auto", auto)):
                cluster = cluster_with(d)
                opts = PartitionOptions(mini_batch=MINI_BATCH[name][d], num_devices=d, schedule=schedule)
                row = gpp_vs_sequential(graph, cluster, opts, timed=True)
                row.update(
                    model=name,
                    devices=d,
                    schedule=schedule if schedule == "auto" else "1F1B",
                    before=next(r for r in before if r["model"] == name and r["devices"] == d)["gpp"],
                )
                rows.append(row)
                print(
                    f"{name:10} {d:>2} rewritten {schedule}: gpp {row['gpp']:10.1f} "
                    f"(as given {row['before']:10.1f}) best sequential {row['seq']:10.1f} "
                    f"x{row['gpp'] / row['seq']:.2f} search {row['t_gpp']:.2f}s",
                    flush=True,
                )
    return rows


def _nic_table(rows: list[dict], label: str) -> list[str]:
    lines = [
        f"| model | devices | GPP samples/s | best sequential samples/s | sequential planner | GPP/sequential | GPP structure | GPP depth | GPP, own links | GPP {label}/own |",
        "| --- | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['gpp']:.1f} | {r['seq']:.1f} | {r['method']} | "
            f"{r['gpp'] / r['seq']:.2f}x | {r['structure']} | {r['depth']} | {r['own']['gpp']:.1f} | "
            f"{r['gpp'] / r['own']['gpp']:.2f} |"
        )
    return lines


def _piper_cell(r: dict) -> str:
    if r["piper"] is not None:
        return f"{r['piper']:.1f}"
    if (r["piper_reason"] or "").startswith("intractable"):
        return f"intractable ({r['ideals']:.3g} ideals)"
    return "infeasible"


if __name__ == "__main__":
    main()
