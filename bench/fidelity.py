"""Fidelity of the predictions (issue #28): plans' predicted iteration time against what ``launch``
measures, on CPU gloo ranks of this machine, with the cluster spec ``tessera calibrate`` writes.

Per model (the zoo's tiny models and real exports of the corpus), seven training plans: one device at
one and at four micro-batches, two devices at three micro-batch sizes (GPP; at the whole
mini-batch it is one stage data-parallel over both ranks), the sequential (SPP) plan, and GPipe's
schedule. Each is planned twice, with the roofline of the calibrated spec and
with ``--profile`` (operators measured, then the chosen plan's stages measured as the executor runs
them: the seven plans' stages together, their bursts in turns, so the host's drift while they are
measured falls on all seven alike), and launched three times, in rounds over the model's plans. Per model: mean
|measured/predicted - 1| and Kendall's tau between the predicted and the measured order.
Placement plans (``tessera place``) in the same run: predicted against launched latency.

With ``--tensor-parallel``, the plans of tensor-parallel stages instead (``plan --tensor-parallel
2``: one stage on 2 ranks, each with its block of the split products, at one and at four
micro-batches) and a ZeRO-1 plan (one stage on 2 replicas sharding its optimizer state), beside
the same model's data-parallel plan, into ``fidelity_tp.md``.

    .venv/bin/python bench/fidelity.py          # writes bench/results/fidelity.md (~17 min)
    .venv/bin/python bench/fidelity.py --render # the table again from bench/results/fidelity.json
    .venv/bin/python bench/fidelity.py --tensor-parallel  # bench/results/fidelity_tp.md (~6 min)
"""

from __future__ import annotations

import datetime
import itertools
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from cli_runner import run_cli
from corpus.exports import entry

from tessera.backends.profile_cache import ProfileCache
from tessera.core.files import write_atomic
from tessera.core.graph import load_graph
from tessera.core.specs import load_cluster
from tessera.executor.gpp_run import run_gpp_plan
from tessera.executor.launcher import LaunchOptions
from tessera.executor.training import TrainOptions
from tessera.models import build
from tessera.planners.pipeline.plan import plan_gpp
from tessera.planners.pipeline.profile import profile_graph
from tessera.planners.pipeline.search import planned_device_type
from tessera.planners.pipeline.stage_profile import StageProfiler
from tessera.planners.pipeline.types import PartitionOptions

OUT = Path(__file__).parent / "results" / "fidelity.md"
RUN = OUT.with_suffix(".json")  # the measurements the table is rendered from (`--render` again)
OUT_TP = OUT.with_name("fidelity_tp.md")  # --tensor-parallel's table (its run: fidelity_tp.json)
STEPS = 30
LAUNCHES = 3  # per plan: the launches of one plan differ by ±10% on this VM (the host's drift)
MODELS = [  # (label, source, mini-batch)
    ("mmt (zoo)", "zoo:mmt", 16),
    ("gpt (zoo)", "zoo:gpt", 16),
    ("candle_uno (zoo)", "zoo:candle_uno", 64),
    ("BERT export", "bert:legacy:dynamic", 16),
    ("ViT export", "vit:dynamo:dynamic", 16),
    ("ResNet export", "resnet:dynamo:dynamic", 16),
    ("GPT-2 export", "gpt2:legacy:dynamic", 16),
]
TP_MODELS = [  # real exports whose attention and MLP split (tessera.core.tensor_parallel)
    ("Llama-GQA export", "llama-gqa:dynamo:dynamic", 16),
    ("GPT-2 export", "gpt2:legacy:dynamic", 16),
]


def variants(b: int) -> list[tuple[str, str, dict]]:
    """(label, kind, PartitionOptions fields) of the seven plans of a model at mini-batch ``b``.
    "micro-batch B" is the plan `tessera plan` picks on its own for every model here: one stage
    data-parallel over both ranks."""
    return [
        ("1 device, 1 micro-batch", "gpp", {"num_devices": 1, "micro_batch_sizes": (b,)}),
        ("1 device, 4 micro-batches", "gpp", {"num_devices": 1, "micro_batch_sizes": (b // 4,)}),
        ("2 devices, micro-batch B", "gpp", {"num_devices": 2, "micro_batch_sizes": (b,)}),
        ("2 devices, micro-batch B/2", "gpp", {"num_devices": 2, "micro_batch_sizes": (b // 2,)}),
        ("2 devices, micro-batch B/4", "gpp", {"num_devices": 2, "micro_batch_sizes": (b // 4,)}),
        ("2 devices, SPP", "spp", {"num_devices": 2, "micro_batch_sizes": (b // 4,)}),
        ("2 devices, GPipe", "gpp", {"num_devices": 2, "micro_batch_sizes": (b // 4,), "schedule": "gpipe"}),
    ]


def tp_variants(b: int) -> list[tuple[str, str, dict]]:
    """The tensor-parallel plans of a model at mini-batch ``b``, and its ZeRO-1 plan (one stage on
    2 replicas sharding the optimizer state: ``memory_limit`` 3/4 of one device's plan, which then
    does not fit), beside its data-parallel plan."""
    tp = {"num_devices": 2, "tensor_parallel": 2}
    return [
        ("2 devices, micro-batch B", "gpp", {"num_devices": 2, "micro_batch_sizes": (b,)}),
        ("tensor-parallel 2, micro-batch B", "gpp", tp | {"micro_batch_sizes": (b,)}),
        ("tensor-parallel 2, micro-batch B/4", "gpp", tp | {"micro_batch_sizes": (b // 4,)}),
        ("2 replicas, ZeRO-1", "gpp", {"num_devices": 2, "micro_batch_sizes": (b,), "zero": 1, "stages": 1,
                                        "memory_limit": "3/4 of one device"}),
    ]  # fmt: skip


def _options(graph, cluster, b: int, fields: dict) -> PartitionOptions:
    """``fields`` as options; a ``memory_limit`` of "3/4 of one device": that share of the peak
    memory of the model's one-device plan (roofline) at the same micro-batch."""
    if fields.get("memory_limit") == "3/4 of one device":
        alone = PartitionOptions(
            mini_batch=b, precision="fp32", num_devices=1, micro_batch_sizes=fields["micro_batch_sizes"]
        )
        plan, _, _ = plan_gpp(graph, cluster, alone, baseline=False)
        fields = fields | {"memory_limit": 0.75 * plan.stages[0].memory.peak}
    return PartitionOptions(mini_batch=b, precision="fp32", **fields)


def model_path(source: str, folder: Path) -> tuple[str, dict | None]:
    if source.startswith("zoo:"):
        path = folder / f"{source[4:]}.onnx"
        path.write_bytes(build(source[4:], "tiny", 0).SerializeToString())
        return str(path), None
    made = entry(*source.split(":"))
    return str(made.path), {made.input: (1, *made.shape[1:])}


def structure(plan) -> str:
    stages = plan.stages
    tp = f" x tp{stages[0].tensor_parallel}" if stages[0].tensor_parallel > 1 else ""
    tp += " ZeRO-1" if any(st.zero for st in stages) else ""
    if len(stages) == 1:
        replicas = len(stages[0].devices) // stages[0].tensor_parallel
        return f"1 stage x{replicas}{tp}" + (" (DP)" if replicas > 1 else "")
    return f"{len(stages)} stages{tp}"


def _kept(into: dict):
    """A refine that keeps the pipelines it is given (by tensor-parallel degree), unmeasured."""

    def keep(pipes, tensor_parallel: int = 1):
        into.setdefault(tensor_parallel, []).extend(pipes)
        return list(pipes)

    return keep


def _profiler(graph, cluster, cache: ProfileCache, devices: int) -> StageProfiler:
    """What ``plan --profile`` measures stages with (tessera.api.plan_pipeline)."""
    return StageProfiler(graph, planned_device_type(cluster, devices), cache, cluster=cluster)


def model_rows(
    label: str, source: str, b: int, cluster, cache: ProfileCache, folder: Path, plan_variants=variants
) -> list[dict]:
    path, shapes = model_path(source, folder)
    graph = load_graph(path, input_shapes=shapes) if shapes else load_graph(path)
    measured = profile_graph(graph, planned_device_type(cluster, 1), cache=cache)
    # Every pipeline the seven plannings will measure, measured together first (bursts in turns,
    # as one planning measures its plan and the sequential rival): the plans then take their
    # stage times from the cache, all from the same stretch of the host's drift. Tensor-parallel
    # stages are measured on their ranks, one after another.
    pipes: dict[int, list] = {}
    for _, kind, fields in plan_variants(b):
        options = _options(graph, cluster, b, fields)
        plan_gpp(graph, cluster, options, kind=kind, baseline=False, measured=measured, refine=_kept(pipes))
    for t, kept in sorted(pipes.items()):
        _profiler(graph, cluster, cache, 2).refine_all(kept, t)
    plans = []
    for name, kind, fields in plan_variants(b):
        options = _options(graph, cluster, b, fields)
        roofline, _, _ = plan_gpp(graph, cluster, options, kind=kind, baseline=False)
        refine = _profiler(graph, cluster, cache, options.num_devices).refine_all
        plan, _, _ = plan_gpp(
            graph, cluster, options, kind=kind, baseline=False, measured=measured, refine=refine
        )
        plans.append((name, roofline, plan))
    # Each launch's iteration: the median over steps 2..k (one step slowed by another process is
    # noise here). The plans are launched in rounds (each plan once, then again), so that the
    # host's drift over a minute falls on all of them alike; a plan's: its median launch.
    launches: list[list[tuple[float, dict]]] = [[] for _ in plans]
    for _ in range(LAUNCHES):
        for (_, _, plan), mine in zip(plans, launches, strict=True):
            run = run_gpp_plan(plan, graph, path, TrainOptions(steps=STEPS), LaunchOptions(timeout_s=300))
            report = run.to_json()
            parts = stage_medians(run, report["fidelity"]["stages"])
            mine.append((report["fidelity"]["iteration"]["median_s"] * 1e3, parts))
    rows = []
    for (name, roofline, plan), mine in zip(plans, launches, strict=True):
        mine.sort(key=lambda x: x[0])
        launched_ms, stages = mine[len(mine) // 2]
        rows.append(
            {
                "model": label,
                "plan": name,
                "structure": structure(plan),
                "micro_batches": "/".join(str(s.micro_batch_size) for s in plan.stages),
                "roofline_ms": roofline.predicted["iteration_time_s"] * 1e3,
                "predicted_ms": plan.predicted["iteration_time_s"] * 1e3,
                "measured_ms": launched_ms,
                "spread_ms": (mine[0][0], mine[-1][0]),
                "stages": stages,
            }
        )
        print(
            label, name, f"{rows[-1]['measured_ms']:.2f} / {rows[-1]['predicted_ms']:.2f} ms", file=sys.stderr
        )
    return rows


def stage_medians(run, predicted: list[dict]) -> list[dict]:
    """Per stage, its busy, all-reduce and idle time as medians over steps 2.. (as the plan's
    iteration is), not the launch report's means, which one slow step moves: busy of the slowest
    replica, all-reduce of the last to arrive among the ranks it joins, idle the rest of the
    slowest rank's step. Predicted parts: the report's."""
    ranks = {r["rank"]: r["stage"] for r in run.ranks}
    steps = range(1, len(run.steps))
    rows = []
    for st in predicted:
        joined = {st["id"], *run.allreduce_peers.get(st["id"], [])}
        mine = [k for k, stage in ranks.items() if stage == st["id"]]
        busy, allreduce, idle = [], [], []
        for k in steps:
            b = max(run.rank_steps[r][k]["busy_s"] for r in mine)
            a = min(run.rank_steps[r][k]["allreduce_s"] for r, stage in ranks.items() if stage in joined)
            busy.append(b)
            allreduce.append(a)
            idle.append(max(run.steps[k]["iteration_s"] - b - a, 0.0))
        measured = {"busy": busy, "allreduce": allreduce, "idle": idle}
        rows.append(
            {"id": st["id"]}
            | {
                k: {"measured_s": float(np.median(v)), "predicted_s": st[k]["predicted_s"]}
                for k, v in measured.items()
            }
        )
    return rows


def placement_rows(folder: Path) -> list[dict]:
    """``tessera place`` then ``tessera launch --json`` of the placement: latency predicted vs measured."""
    rows = []
    for label, source in (("bert (zoo)", "zoo:bert"), ("ResNet export", "resnet:dynamo:dynamic")):
        path, shapes = model_path(source, folder)
        plan = folder / f"{Path(path).stem}.place.json"
        args = ["place", path, "-o", str(plan), "--cache", str(folder / "place.sqlite")]
        for name, shape in (shapes or {}).items():
            args += ["--input-shape", f"{name}={'x'.join(map(str, shape))}"]
        result = run_cli(*args)
        assert result.code == 0, result.err
        launched = run_cli("launch", str(plan), "--json")
        assert launched.code == 0, launched.err
        report = json.loads(launched.out)
        rows.append(
            {
                "model": label,
                "plan": "placement",
                "structure": ", ".join(report["backends"]) if "backends" in report else "-",
                "micro_batches": "-",
                "roofline_ms": float("nan"),
                "predicted_ms": report["predicted"]["latency_s"] * 1e3,
                "measured_ms": report["measured"]["latency_s"] * 1e3,
                "spread_ms": None,
                "stages": [],
            }
        )
    return rows


def kendall_tau(
    predicted: list[float], measured: list[float], tie: float, spreads: list[float] | None = None
) -> float:
    """Kendall's tau-b-like agreement of the two orders; pairs whose predictions differ by less than
    ``tie`` (relative: the run's noise, :func:`noise`) are ties (the issue: plans within the noise
    may tie) and left out. With ``spreads`` (each plan's own, :func:`own_spread`), a pair's noise is
    the largest of ``tie`` and the two plans' spreads."""
    concordant = discordant = 0
    for i, j in itertools.combinations(range(len(predicted)), 2):
        dp, dm = predicted[i] - predicted[j], measured[i] - measured[j]
        noise_ij = max(tie, *(spreads[i], spreads[j])) if spreads else tie
        if abs(dp) <= noise_ij * max(predicted[i], predicted[j]):
            continue
        concordant += dp * dm > 0
        discordant += dp * dm < 0
    total = concordant + discordant
    return (concordant - discordant) / total if total else 1.0


def own_spread(row: dict) -> float:
    """A plan's own noise: (slowest - fastest launch) / the median launch."""
    return (row["spread_ms"][1] - row["spread_ms"][0]) / row["measured_ms"] if row["spread_ms"] else 0.0


def noise(rows: list[dict]) -> float:
    """This run's noise: the median over its training plans of their :func:`own_spread`, what the
    same plan launched again moves by."""
    spreads = [own_spread(r) for r in rows if r["spread_ms"]]
    return float(np.median(spreads)) if spreads else 0.0


def calibrated(folder: Path) -> Path:
    spec = folder / "calibrated.yaml"
    result = run_cli("calibrate", "-o", str(spec))
    assert result.code == 0, result.err
    return spec


def main() -> None:
    args = sys.argv[1:]
    split = "--tensor-parallel" in args
    out, run_file = (OUT_TP, OUT_TP.with_suffix(".json")) if split else (OUT, RUN)
    if args[:1] == ["--render"]:  # the table again from the last run's measurements
        run = json.loads(run_file.read_text())
        write_atomic(out, render(run["rows"], run["spec"], split))
        print(out.read_text())
        return
    only = [a for a in args if not a.startswith("--")]  # labels to run (all by default), e.g. `mmt`
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        spec = calibrated(folder)
        spec_text = spec.read_text()
        cluster = load_cluster(str(spec))
        cache = ProfileCache(folder / "profiles.sqlite")
        rows = []
        for label, source, b in TP_MODELS if split else MODELS:
            if not only or any(o in label for o in only):
                rows += model_rows(
                    label, source, b, cluster, cache, folder, tp_variants if split else variants
                )
        if not split and (not only or "placement" in only):
            rows += placement_rows(folder)
    write_atomic(run_file, json.dumps({"rows": rows, "spec": spec_text}, indent=1, default=float) + "\n")
    write_atomic(out, render(rows, spec_text, split))
    print(out.read_text())


def _error(r: dict, key: str = "predicted_ms") -> float:
    return r["measured_ms"] / r[key] - 1


def render(rows: list[dict], spec_text: str, split: bool = False) -> str:
    plans = (
        "a model's plans' stages measured together, their bursts in turns; a tensor-parallel "
        "stage on its 2 ranks (each its block of the split products, the collectives over gloo), "
        "one stage after another"
        if split
        else "a model's seven plans' stages measured together, their bursts in turns"
    ) + (
        "; a data-parallel stage's 2 replicas on 2 ranks computing at once, each step's part the "
        "slower replica's"
    )
    lines = [
        "# Fidelity: predicted against launched (CPU, gloo)"
        + (", tensor-parallel and ZeRO-1 stages" if split else ""),
        "",
        f"Machine: {platform.processor() or platform.machine()}, 2 cores; every rank one process with one "
        f"thread; {STEPS} SGD steps per launch, a launch's iteration = median over steps 2..{STEPS} of the "
        f"slowest rank; each plan launched {LAUNCHES} times (in rounds: a model's plans once each, then "
        "again), measured = the median launch (its per-stage parts: medians over the same steps, busy "
        "of the slowest replica, all-reduce of the last rank to arrive, idle the rest of the step; "
        "'launches': the fastest and slowest). "
        "Cluster spec: `tessera calibrate` in the same run (below). 'roofline' = the plan's prediction "
        "with the calibrated spec's roofline; 'profiled' = `--profile` (operators measured for the "
        "search, then the chosen plan's stages measured as the executor runs them: its program, its "
        f"micro-batch, one thread, the optimizer step and the data drawn each step; {plans}).",
        "",
        f"Generated on {datetime.date.today().isoformat()} by `.venv/bin/python bench/fidelity.py"
        + (" --tensor-parallel" if split else "")
        + f"` (torch {torch.__version__}, Python {platform.python_version()}).",
        "",
        "| model | plan | structure | micro-batch | roofline ms | profiled ms | measured ms | launches ms | "
        "error (profiled) | error (roofline) | per stage: busy / all-reduce / idle, measured vs predicted ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        parts = "<br>".join(
            f"{st['id']}: "
            + ", ".join(
                f"{st[k]['measured_s'] * 1e3:.2f}/{(st[k]['predicted_s'] or 0) * 1e3:.2f}"
                for k in ("busy", "allreduce", "idle")
            )
            for st in r["stages"]
        )
        roof = f"{r['roofline_ms']:.2f}" if np.isfinite(r["roofline_ms"]) else "-"
        roof_err = f"{_error(r, 'roofline_ms'):+.0%}" if np.isfinite(r["roofline_ms"]) else "-"
        spread = f"{r['spread_ms'][0]:.2f}–{r['spread_ms'][1]:.2f}" if r["spread_ms"] else "-"
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['structure']} | {r['micro_batches']} | {roof} | "
            f"{r['predicted_ms']:.2f} | {r['measured_ms']:.2f} | {spread} | {_error(r):+.0%} | {roof_err} | {parts} |"
        )
    lines += ["", "## Per model", "", "| model | plans | mean abs error (profiled) | mean abs error (roofline) | "
              "Kendall tau (profiled) | Kendall tau, each pair's own noise |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    summary = []
    tie = noise([r for r in rows if r["plan"] != "placement"])
    for model in dict.fromkeys(r["model"] for r in rows if r["plan"] != "placement"):
        mine = [r for r in rows if r["model"] == model and r["plan"] != "placement"]
        mean = float(np.mean([abs(_error(r)) for r in mine]))
        roof = float(np.mean([abs(_error(r, "roofline_ms")) for r in mine]))
        predicted, measured = [r["predicted_ms"] for r in mine], [r["measured_ms"] for r in mine]
        tau = kendall_tau(predicted, measured, tie)
        own = kendall_tau(predicted, measured, tie, [own_spread(r) for r in mine])
        summary.append((mean, roof, tau, own))
        lines.append(f"| {model} | {len(mine)} | {mean:.0%} | {roof:.0%} | {tau:+.2f} | {own:+.2f} |")
    placements = [r for r in rows if r["plan"] == "placement"]
    lines += [
        "",
        f"Over all training plans: mean |measured/predicted - 1| {np.mean([s[0] for s in summary]):.0%} "
        f"profiled, {np.mean([s[1] for s in summary]):.0%} roofline; Kendall tau from "
        f"{min(s[2] for s in summary):+.2f} to {max(s[2] for s in summary):+.2f} (plans whose "
        f"predictions differ by less than this run's noise, {tie:.0%}, tie: the median over the plans "
        "of their launches' spread, slowest - fastest over the median); with each pair's own noise "
        "(the larger of that and the two plans' own spreads) from "
        f"{min(s[3] for s in summary):+.2f} to {max(s[3] for s in summary):+.2f}.",
        "Placements: " + ("; ".join(f"{r['model']} {_error(r):+.0%}" for r in placements) or "-") + ".",
        "",
        "## The calibrated cluster spec",
        "",
        "```yaml",
        spec_text.rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
