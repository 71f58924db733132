from __future__ import annotations

import csv
import io
import json

import click
import pytest
from cli_runner import run_cli
from click.testing import CliRunner
from planners.pipeline.gpp_graphs import chain

from tessera.cli.plan.pipeline import run_pipeline_plan, write_pytorch_csv
from tessera.core.errors import InfeasibleError, InputError
from tessera.core.graph import load_graph, rewritten
from tessera.core.plan_checks import check_plan_against_model
from tessera.core.plans import dump_plan, load_plan, parse_plan
from tessera.core.schedule import to_pytorch_csv
from tessera.core.specs import ClusterSpec
from tessera.models import build
from tessera.planners.pipeline.plan import plan_gpp
from tessera.planners.pipeline.types import PartitionOptions


@pytest.fixture(scope="module")
def graph(zoo_graph):
    return zoo_graph("candle_uno")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, zoo):
    """The tiny CANDLE-Uno as an ONNX file, for runs through the CLI."""
    path = tmp_path_factory.mktemp("model") / "cu.onnx"
    path.write_bytes(zoo("candle_uno").SerializeToString())
    return path


def test_run_writes_plan_gantt_and_summary(tmp_path, graph, v100, capsys) -> None:
    out = tmp_path / "plan.json"
    svg = tmp_path / "gantt.svg"
    plan = run_pipeline_plan(graph, v100, mini_batch=64, devices=4, output=out, gantt=svg)
    text = capsys.readouterr().out
    assert "GPP plan" in text and "SPP baseline" in text
    loaded = load_plan(out)
    assert loaded == plan
    assert check_plan_against_model(loaded, graph) == []
    assert svg.read_text().lstrip().startswith("<?xml")
    for key in ("iteration_time_s", "throughput_samples_per_s", "pipeline_depth", "bubble_fraction"):
        assert key in loaded.predicted


def test_json_and_exit_code_through_click(graph, v100) -> None:

    @click.command()
    @click.option("--memory-limit", default=None)
    @click.option("--json", "as_json", is_flag=True)
    def plan(memory_limit, as_json):
        try:
            run_pipeline_plan(
                graph, v100, mini_batch=32, devices=2, memory_limit=memory_limit, as_json=as_json
            )
        except InfeasibleError as exc:
            click.echo(exc.one_line(), err=True)
            raise SystemExit(exc.exit_code) from None

    runner = CliRunner()
    ok = runner.invoke(plan, ["--json"])
    assert ok.exit_code == 0
    assert json.loads(ok.output)["kind"] == "gpp"
    bad = runner.invoke(plan, ["--memory-limit", "1KiB"])
    assert bad.exit_code == 3


def test_plan_on_shared_network_interfaces(tmp_path, graph, v100) -> None:
    # One interface per node: the plan records it, passes the checks, and its prediction comes
    # from a simulation whose inter-node transfers queue at the interfaces they cross.
    data = v100.to_json_dict()
    data["links"]["nics"] = "per-node"
    cluster = ClusterSpec.from_json_dict(data)
    out = tmp_path / "plan.json"
    plan = run_pipeline_plan(graph, cluster, mini_batch=64, devices=8, output=out)
    loaded = load_plan(out)
    assert loaded == plan and loaded.cluster["links"]["nics"] == "per-node"
    assert check_plan_against_model(loaded, graph) == []
    assert loaded.predicted["throughput_samples_per_s"] > 0


MIXED = """
name: mixed
device_types:
  a100: {kind: gpu, memory: 80GiB, flops: {fp32: 19.5TFLOPS, fp16: 312TFLOPS}, memory_bandwidth: 2039GB/s}
  t4: {kind: gpu, memory: 16GiB, flops: {fp32: 8.1TFLOPS, fp16: 65TFLOPS}, memory_bandwidth: 320GB/s}
nodes:
  - {name: n, count: 1, devices: [{type: a100, count: 2}, {type: t4, count: 2}]}
links:
  intra_node: {bandwidth: 50GB/s, latency: 2us}
"""


@pytest.mark.parametrize("kind", ["gpp", "spp"])
def test_a_cluster_of_mixed_device_types_is_refused_unless_devices_selects_one(
    tmp_path, model_file, kind
) -> None:
    # The cost model and the memory limit are per device type: planning a100s and t4s with the
    # a100's costs would mispredict every t4 stage, so the planner says so and how to go on.
    spec = tmp_path / "mixed.yaml"
    spec.write_text(MIXED)
    out = tmp_path / "plan.json"
    args = [
        "plan",
        str(model_file),
        "--kind",
        kind,
        "--cluster",
        str(spec),
        "--mini-batch",
        "64",
        "-o",
        str(out),
    ]
    bad = run_cli(*args)
    assert bad.code == 2 and not out.exists()
    lines = bad.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in bad.err
    assert str(spec) in lines[0] and "a100 x2, t4 x2" in lines[0] and "--devices" in lines[0]
    ok = run_cli(*args, "--devices", "2")
    assert ok.code == 0, ok.err
    assert all("a100" in d for st in load_plan(out).stages for d in st.devices)


@pytest.mark.parametrize(
    ("limit", "fault"),
    [
        ("0", "must be greater than zero"),
        ("-5GB", "must not be negative"),
        ("12parsecs", "unknown unit 'parsecs'"),
    ],
)
def test_a_bad_memory_limit_is_bad_input(model_file, limit, fault) -> None:
    # Exit 2 with one line naming the option, not an internal error (exit 1) or "no plan fits 0 B".
    res = run_cli("plan", str(model_file), "--kind", "gpp", "--cluster", "graphpipe-v100", "--mini-batch", "8",
                  "--memory-limit", limit)  # fmt: skip
    lines = res.err.strip().splitlines()
    assert res.code == 2 and len(lines) == 1
    assert lines[0].startswith(f"tessera: error: --memory-limit: {fault}")


def _torch_pipelining_accepts(csv_text: str, stages: int, micro_batches: int) -> None:
    """``torch.distributed.pipelining``'s own checks of a compute-only CSV, as its runtime's
    ``_load_csv`` makes them: every cell parses as an action, each stage's passes come in a
    valid order on one rank; then its lowering adds the sends and receives, and its dry run of
    that schedule raises if the ranks deadlock (the lowering itself fails on some deadlocks)."""
    from torch.distributed.pipelining import schedules as pp

    rows = csv.reader(io.StringIO(csv_text))
    actions = {rank: [pp._Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}
    pp._validate_schedule(actions, stages, stages, micro_batches)
    comms = pp._add_send_recv(actions, stage_to_rank=lambda s: s, num_stages=stages)
    pp._simulate_comms_compute(comms, stage_to_rank=lambda s: s, num_stages=stages)


def test_torch_pipelining_catches_a_deadlocking_schedule() -> None:
    """The check above bites: stage 0 waits for B0 before F1, stage 1 for F1 before B0."""
    with pytest.raises((AssertionError, ValueError), match="not progressing|can't schedule sends/recvs"):
        _torch_pipelining_accepts("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n", 2, 2)


@pytest.mark.parametrize("schedule", ["1f1b", "kfkb", "gpipe", "greedy", "auto"])
def test_a_chain_plan_exports_a_schedule_torch_pipelining_runs(tmp_path, graph, v100, schedule) -> None:
    options = PartitionOptions(
        mini_batch=64,
        num_devices=4,
        schedule=schedule,
        k=2 if schedule == "kfkb" else 1,
        micro_batch_sizes=(8,),
    )
    plan, _, _ = plan_gpp(graph, v100, options, kind="spp", baseline=False)
    assert len(plan.stages) > 1 and plan.mini_batch_size // plan.stages[0].micro_batch_size == 8
    path = write_pytorch_csv(plan, tmp_path / "schedule.csv")
    text = path.read_text()
    assert text.splitlines()[0].startswith("0F0,")
    _torch_pipelining_accepts(text, len(plan.stages), 8)


def test_pytorch_csv_through_the_cli(tmp_path, model_file) -> None:
    """``--kind spp --pytorch-csv``: the plan's own schedules; a graph of stages: exit 2 naming
    the file, after the plan itself is written."""
    args = ("plan", str(model_file), "--cluster", "graphpipe-v100", "--mini-batch", "64", "--devices", "4")
    out, csv_path = tmp_path / "spp.json", tmp_path / "spp.csv"
    res = run_cli(*args, "--kind", "spp", "-o", str(out), "--pytorch-csv", str(csv_path))
    assert res.code == 0, res.err
    plan = load_plan(out)
    assert csv_path.read_text() == to_pytorch_csv({st.id: st.schedule.actions for st in plan.stages})
    out, csv_path = tmp_path / "gpp.json", tmp_path / "gpp.csv"
    res = run_cli(*args, "--kind", "gpp", "-o", str(out), "--pytorch-csv", str(csv_path))
    lines = res.err.strip().splitlines()
    assert res.code == 2 and len(lines) == 1, res.err
    assert f"{csv_path}: --pytorch-csv: stage 0 does not feed stage 1" in lines[0]
    assert load_plan(out).kind == "gpp" and not csv_path.exists()


def test_a_k_beyond_the_micro_batches_is_bad_input(model_file) -> None:
    """``--k 1e20`` ran for ever (kFkB's loops are linear in k): exit 2 naming --k."""
    res = run_cli("plan", str(model_file), "--kind", "gpp", "--cluster", "local-cpu-split", "--mini-batch", "8",
                  "--schedule", "kfkb", "--k", "99999999999999999999")  # fmt: skip
    lines = res.err.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and "--k 99999999999999999999" in lines[0], res.err


def test_kind_defaults_to_gpp(tmp_path, model_file) -> None:
    """The issue's command line, ``tessera plan MODEL --cluster C.yaml [--kind gpp|spp]``: without
    --kind the plan is a GPP plan, byte-identical to the one ``--kind gpp`` writes."""
    args = ("plan", str(model_file), "--cluster", "local-cpu-split", "--mini-batch", "8")
    default, explicit = tmp_path / "default.json", tmp_path / "gpp.json"
    assert run_cli(*args, "-o", str(default)).code == 0
    assert run_cli(*args, "--kind", "gpp", "-o", str(explicit)).code == 0
    assert load_plan(default).kind == "gpp"
    assert default.read_bytes() == explicit.read_bytes()


def test_a_decoding_option_without_kind_says_kind_cp() -> None:
    """With --kind left at its default (gpp), a cp option gets the hint a user needs."""
    res = run_cli("plan", "--llm", "gpt2", "--cluster", "h200", "--batch", "4", "--context", "1K")
    lines = res.err.strip().splitlines()
    assert res.code == 2 and len(lines) == 1, res.err
    assert "--llm does not apply to --kind gpp (the default kind; decoding plans need --kind cp)" in lines[0]


def test_an_option_of_another_kind_is_named_as_typed() -> None:
    # The option's parameter is "rewrites" (it repeats); the message names the flag, --rewrite.
    args = ["plan", "--kind", "cp", "--llm", "gpt2", "--cluster", "h200", "--batch", "4", "--context", "1K"]
    res = run_cli(*args, "--rewrite", "auto")
    assert res.code == 2 and "--rewrite does not apply to --kind cp" in res.err, res.err


@pytest.mark.parametrize("schedule", ["1f1b", "greedy", "gpipe", "auto"])
def test_k_without_kfkb_is_a_usage_error(tmp_path, model_file, schedule) -> None:
    """``--k 4`` with another schedule was silently ignored: the user asked for kFkB's k."""
    out = tmp_path / "plan.json"
    res = run_cli("plan", str(model_file), "--cluster", "local-cpu-split", "--mini-batch", "8",
                  "--schedule", schedule, "--k", "4", "-o", str(out))  # fmt: skip
    lines = res.err.strip().splitlines()
    assert res.code == 2 and len(lines) == 1, res.err
    assert f"--k is the k of kFkB: it needs --schedule kfkb (not {schedule})" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("field,value", [("flops", {"fp32": 1e-200}), ("kernel_launch_overhead", 1e200)])
def test_extreme_device_speeds_still_plan(tmp_path, graph, cluster, field, value) -> None:
    """Operator times near the float range: the bisection's geometric mean overflowed to inf and
    the search never ended. Now it ends, and the plan holds C1-C5."""
    data = cluster("local-cpu-split").to_json_dict()
    for device_type in data["device_types"].values():
        device_type[field] = value
    extreme = ClusterSpec.from_json_dict(data)
    plan, _, _ = plan_gpp(graph, extreme, PartitionOptions(mini_batch=8), baseline=False)
    assert check_plan_against_model(plan, graph) == []


def test_a_memory_limit_above_the_device_memory_is_refused(graph, v100) -> None:
    # A plan over the device's memory would not run (validate rejects it): the limit only lowers.
    with pytest.raises(InputError, match=r"--memory-limit 1\.0 TiB is more than a v100-16g's 15\.8 GiB"):
        run_pipeline_plan(graph, v100, mini_batch=32, devices=2, memory_limit="1TiB")
    run_pipeline_plan(graph, v100, mini_batch=32, devices=2, memory_limit="15GiB")  # below it: plans


def test_validate_refuses_what_the_executor_cannot_run() -> None:
    # Both passed validate; launch then refused the first with exit 4, and ran the second as a
    # graph of stages under the label of a sequential plan.
    from executor.plans import make_plan
    from planners.pipeline.gpp_graphs import n_shaped

    g = n_shaped()
    tiny = make_plan(g, [(list(g.order), ["a", "b"], 1)], mini_batch=2)
    problems = check_plan_against_model(tiny, g)
    assert problems == [
        "stage 0: micro-batch 1 is smaller than its 2 data-parallel replicas (a replica needs a sample)"
    ]
    branches = [["a", "c"], ["b"], ["d_add", "d"]]  # stages 0 and 1 both feed stage 2
    graph_as_spp = make_plan(g, [(nodes, [f"c{i}"], 2) for i, nodes in enumerate(branches)], 4, kind="spp")
    problems = check_plan_against_model(graph_as_spp, g)
    assert "spp: a sequential plan runs its stages 0->1->…->2 in order; edge 0->1 is missing" in problems
    assert (
        check_plan_against_model(
            make_plan(g, [(nodes, [f"c{i}"], 2) for i, nodes in enumerate(branches)], 4), g
        )
        == []
    )


def test_gantt_is_the_same_bytes_for_the_same_plan(tmp_path, graph, v100) -> None:
    # matplotlib names SVG elements with random ids unless salted: two runs drew different files.
    for name in ("a.svg", "b.svg"):
        run_pipeline_plan(graph, v100, mini_batch=32, devices=4, gantt=tmp_path / name, no_baseline=True)
    first = (tmp_path / "a.svg").read_bytes()
    assert first == (tmp_path / "b.svg").read_bytes()
    assert b"forward" in first and b"stage 0" in first  # text kept as text (svg.fonttype none)


def test_recompute_and_bytes_per_param_from_the_command_line(tmp_path) -> None:
    model = tmp_path / "gpt.onnx"
    model.write_bytes(build("gpt", "tiny").SerializeToString())
    args = ["plan", str(model), "--cluster", "graphpipe-v100", "--mini-batch", "8", "--devices", "4"]
    tight = [*args, "--memory-limit", "200KiB", "--no-baseline"]
    refused = run_cli(*tight)
    assert refused.code == 3 and "(--recompute auto recomputes activations where a stage needs" in refused.err
    out = tmp_path / "plan.json"
    assert run_cli(*tight, "--recompute", "-o", str(out)).code == 0  # alone: every stage
    plan = load_plan(out)
    assert plan.training.recompute == "all" and all(st.recompute for st in plan.stages)
    assert max(st.memory.peak for st in plan.stages) <= 200 * 1024
    assert run_cli("validate", str(out)).code == 0
    assert run_cli(*tight, "--recompute", "auto", "-o", str(out)).code == 0
    plan = load_plan(out)
    assert plan.training.recompute == "auto" and 0 < sum(st.recompute for st in plan.stages) < len(
        plan.stages
    )
    assert run_cli("validate", str(out)).code == 0
    shown = run_cli(*tight, "--recompute", "auto").out.splitlines()
    assert "recompute" in shown[1].split()  # the column, only where recomputation was allowed
    assert [line.split()[7] for line in shown[2:-1]] == [
        "yes" if st.recompute else "no" for st in plan.stages
    ]
    assert "recompute" not in run_cli(*args, "--no-baseline").out
    swallowed = run_cli("plan", "--recompute", str(model), "--cluster", "graphpipe-v100", "--mini-batch", "8")
    assert swallowed.code == 2 and "it looks like the model: write --recompute after MODEL" in swallowed.err
    wrong = run_cli(*tight, "--recompute", "some")
    assert wrong.code == 2 and "'some' is not one of 'never', 'auto', 'all'" in wrong.err
    lean = tmp_path / "lean.json"
    assert run_cli(*args, "--bytes-per-param", "8", "--no-baseline", "-o", str(lean)).code == 0
    assert load_plan(lean).training.bytes_per_param == 8.0
    assert all(st.memory.optimizer == 3 * st.memory.weights for st in load_plan(lean).stages)  # 2 + 6
    low = run_cli(*args, "--bytes-per-param", "3")
    assert low.code == 2 and "below what its weight and gradient take (4 at mixed precision)" in low.err


def test_sequential_plans_with_skip_edges_are_valid(cluster, zoo_graph) -> None:
    # A residual crossing two stages makes an edge 0->2 next to the chain 0->1->2: the first
    # chain check refused every such spp plan that plan itself wrote.
    g = zoo_graph("bert")
    plan, _, _ = plan_gpp(g, cluster("dgx-a100"), PartitionOptions(mini_batch=16), kind="spp")
    edges = {(e.src, e.dst) for e in plan.edges}
    assert any(dst > src + 1 for src, dst in edges)
    assert check_plan_against_model(plan, g) == []


@pytest.mark.parametrize(
    ("training", "fragment"),
    [
        ({"bytes_per_param": 2.0}, "training.bytes_per_param: 2 bytes per parameter is below"),
        ({"precision": "fp32", "bytes_per_param": 4.0}, "(8 at fp32 precision)"),
        (
            {"bytes_per_param": 1e308},
            "field training.bytes_per_param: Input should be less than or equal to 1024",
        ),
        ({"recompute": "all"}, "memory: stage 0 keeps its activations, but training.recompute is 'all'"),
        ({"recompute": "sometimes"}, "field training.recompute: Input should be 'never', 'auto' or 'all'"),
    ],
)
def test_a_plan_s_training_setup_is_checked(tmp_path, graph, v100, training, fragment) -> None:
    # Each was an internal error (ValueError, OverflowError) in validate.
    plan, _, _ = plan_gpp(graph, v100, PartitionOptions(mini_batch=32, num_devices=2))
    data = json.loads(dump_plan(plan))
    data["training"].update(training)
    try:
        problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    except InputError as exc:  # the schema's bound
        problems = [exc.message]
    assert any(fragment in p for p in problems), problems


def test_a_stage_recomputing_against_the_plan_s_setting_is_reported(graph, v100) -> None:
    plan, _, _ = plan_gpp(graph, v100, PartitionOptions(mini_batch=32, num_devices=4))
    data = json.loads(dump_plan(plan))
    data["stages"][-1]["recompute"] = True
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    last = len(plan.stages) - 1
    assert f"memory: stage {last} recomputes its activations, but training.recompute is 'never'" in problems
    for st in data["stages"]:
        st["recompute"] = True
    del data["training"]
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    ids = ", ".join(str(i) for i in range(last + 1))
    assert (
        f"memory: stages {ids} recompute their activations, but training.recompute is 'never' "
        "(its default: the plan does not say)" in problems
    ), problems
    data["training"] = {"recompute": "auto"}  # the planner's choice: any stage may
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    assert not any("training.recompute" in p for p in problems), problems


@pytest.mark.parametrize("every", [True, False])
def test_plans_with_the_older_boolean_recompute_read_as_all_or_never(graph, v100, every) -> None:
    # Before recomputation was chosen per stage, training.recompute was a boolean for every stage.
    plan, _, _ = plan_gpp(
        graph,
        v100,
        PartitionOptions(mini_batch=32, num_devices=2, recompute="all" if every else "never"),
    )
    data = json.loads(dump_plan(plan))
    data["training"]["recompute"] = every
    for st in data["stages"]:
        del st["recompute"]
    older = parse_plan(data, label="plan.json")
    assert older == plan
    assert check_plan_against_model(older, graph) == []


def test_bytes_per_param_nan_is_bad_input(graph, v100) -> None:
    with pytest.raises(InputError, match=r"--bytes-per-param nan: expected a number of bytes in \(0, 1024\]"):
        run_pipeline_plan(graph, v100, mini_batch=32, devices=2, bytes_per_param=float("nan"))


def test_rewrite_is_recorded_in_the_plan_validated_and_refused_when_it_is_edited_away(
    tmp_path, model_file
) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", str(model_file), "--cluster", "graphpipe-v100", "--mini-batch", "64", "--devices", "4"]
    ran = run_cli(*args, "--rewrite", "concat-matmul", "-o", str(out))
    assert ran.code == 0 and "model rewritten (concat-matmul)" in ran.out.splitlines()[0]
    again = run_cli(*args, "--rewrite", "concat-matmul", "--rewrite", "concat-matmul", "--json")
    assert again.out == out.read_text()  # deterministic; a rewrite given twice is applied once
    plan = load_plan(out)
    assert plan.model.rewrites == ["concat-matmul"]
    named = {n for st in plan.stages for n in st.nodes}
    assert {f"top/layer0/fc/gemm/part{i}" for i in range(7)} <= named and "merge/concat" not in named
    assert run_cli("validate", str(out)).code == 0
    data = json.loads(out.read_text())
    data["model"]["rewrites"] = []
    out.write_text(json.dumps(data))
    edited = run_cli("validate", str(out))
    why = (
        "the plan names the operators of the model rewritten by concat-matmul, which model.rewrites "
        "(none) does not list: add it there, or plan again"
    )
    assert edited.code == 2 and why in edited.err
    data["model"]["rewrites"] = ["concat-matmul"]
    data["model"]["num_nodes"] = 71
    out.write_text(json.dumps(data))
    count = run_cli("validate", str(out))  # the rewrite listed, the count edited: no rewrite to name
    assert count.code == 2 and "model.num_nodes is 71; the model has 72 operators" in count.err
    data["model"]["rewrites"] = ["fuse-all"]
    out.write_text(json.dumps(data))
    unknown = run_cli("validate", str(out))
    why = "field model.rewrites: unknown graph rewrite 'fuse-all' (known: reduce-concat, concat-matmul)"
    assert unknown.code == 2 and why in unknown.err
    assert len(unknown.err.strip().splitlines()) == 1
    bad = run_cli(*args, "--rewrite", "fuse-all")
    assert bad.code == 2 and "'fuse-all' is not one of 'reduce-concat', 'concat-matmul', 'all'" in bad.err
    every = run_cli(*args, "--rewrite", "all", "--json")
    assert json.loads(every.out)["model"]["rewrites"] == ["reduce-concat", "concat-matmul"]
    assert json.loads(every.out)["stages"] == json.loads(again.out)["stages"]  # reduce-concat: no match
    as_given = run_cli(*args, "--no-baseline")
    assert "model rewritten" not in as_given.out
    hint = "hint: --rewrite concat-matmul would replace merge/concat, top/layer0/fc/gemm; plan with it"
    assert hint in as_given.err and "hint" not in ran.err


# tiny CANDLE-Uno: as given kept at 2, rewritten at 8 (slow: each run searches 8 devices, auto twice)
@pytest.mark.parametrize("devices", ["2", pytest.param("8", marks=pytest.mark.slow)])
def test_rewrite_auto_keeps_the_faster_of_the_model_as_given_and_rewritten(
    tmp_path, model_file, devices
) -> None:
    args = [
        "plan",
        str(model_file),
        "--cluster",
        "graphpipe-v100",
        "--mini-batch",
        "64",
        "--devices",
        devices,
    ]
    given = json.loads(run_cli(*args, "--json").out)
    rewritten = json.loads(run_cli(*args, "--rewrite", "concat-matmul", "--json").out)  # what applies
    speed = [p["predicted"]["throughput_samples_per_s"] for p in (given, rewritten)]
    assert speed[0] != speed[1]  # a real choice
    auto = run_cli(*args, "--rewrite", "auto", "--json")
    assert auto.code == 0
    assert json.loads(auto.out) == (rewritten if speed[1] > speed[0] else given)
    text = run_cli(*args, "--rewrite", "auto")
    line = next(x for x in text.out.splitlines() if x.startswith("rewrite auto: "))
    kept = "rewritten (concat-matmul)" if speed[1] > speed[0] else "as given"
    assert f"{kept} {max(speed):,.1f} samples/s (kept)" in line
    assert f"{min(speed):,.1f} samples/s;" in line or line.endswith(f"{min(speed):,.1f} samples/s")
    assert "hint" not in text.err  # auto already compared
    tight = run_cli(*args, "--rewrite", "auto", "--memory-limit", "16KiB")
    alone = run_cli(*args, "--memory-limit", "16KiB")
    assert (
        tight.code == alone.code == 3 and tight.err == alone.err
    )  # neither fits: the model as given's error


def test_validate_names_a_rewrite_lost_before_one_kept(tmp_path) -> None:
    """Tiny MMT planned with both rewrites; the plan's model.rewrites edited to the second only:
    validate reads the model file again to name the first."""
    model, out = tmp_path / "mmt.onnx", tmp_path / "plan.json"
    model.write_bytes(build("mmt", "tiny").SerializeToString())
    ran = run_cli("plan", str(model), "--cluster", "graphpipe-v100", "--mini-batch", "16", "--devices", "4",
                  "--rewrite", "all", "-o", str(out))  # fmt: skip
    assert ran.code == 0 and load_plan(out).model.rewrites == ["reduce-concat", "concat-matmul"]
    data = json.loads(out.read_text())
    data["model"]["rewrites"] = ["concat-matmul"]
    out.write_text(json.dumps(data))
    res = run_cli("validate", str(out))
    why = "rewritten by reduce-concat, which model.rewrites (concat-matmul) does not list"
    assert res.code == 2 and why in res.err, res.err


def test_rewrite_auto_stands_alone_and_changes_nothing_where_no_rewrite_applies(tmp_path) -> None:
    chain_file = tmp_path / "chain.onnx"
    chain_file.write_bytes(chain(6, width=64).named_model().SerializeToString())
    args = ["plan", str(chain_file), "--cluster", "graphpipe-v100", "--mini-batch", "16", "--devices", "2"]
    auto = run_cli(*args, "--rewrite", "auto")
    assert auto.code == 0 and "rewrite auto" not in auto.out and "rewritten" not in auto.out
    assert run_cli(*args, "--rewrite", "auto", "--json").out == run_cli(*args, "--json").out
    mixed = run_cli(*args, "--rewrite", "auto", "--rewrite", "concat-matmul")
    assert mixed.code == 2 and "--rewrite auto chooses the rewrites itself: give it alone" in mixed.err


def test_rewritten_graph_is_the_one_load_graph_gives(model_file) -> None:
    given = load_graph(model_file)
    direct = load_graph(model_file, rewrites=["concat-matmul", "reduce-concat"])
    derived = rewritten(given, ["concat-matmul", "reduce-concat"])
    assert derived.rewrites == direct.rewrites == ("reduce-concat", "concat-matmul")
    assert derived.order == direct.order and derived.sha256 == direct.sha256 == given.sha256
    assert sorted(derived.dag.edges) == sorted(direct.dag.edges)
    assert derived.model.SerializeToString(deterministic=True) == direct.model.SerializeToString(
        deterministic=True
    )
    with pytest.raises(ValueError, match="already rewritten"):
        rewritten(direct, ["concat-matmul"])


def test_a_profiled_plan_of_several_cpu_ranks_on_a_presets_links_hints_at_calibrate(zoo_graph) -> None:
    # On this machine a preset's links priced an all-reduce at 0.2 ms that took 3 ms: a plan of
    # several CPU ranks measured without a calibrated spec says how to get one.
    from tessera.cli.plan.pipeline import _uncalibrated_hint
    from tessera.core.specs import load_cluster
    from tessera.planners.pipeline.plan import pipeline_options

    mmt, preset = zoo_graph("mmt"), load_cluster("local-cpu-split")
    plans = {
        devices: plan_gpp(
            mmt, preset, pipeline_options(preset, mini_batch=16, devices=devices), baseline=False
        )[0]
        for devices in (1, 2)
    }
    assert [sum(len(st.devices) for st in plans[d].stages) for d in (1, 2)] == [1, 2]
    assert "tessera calibrate" in (_uncalibrated_hint(preset, plans[2]) or "")
    assert _uncalibrated_hint(preset, plans[1]) is None
    measured = preset.model_copy(
        update={
            "device_types": {
                name: t.model_copy(update={"action_overhead": 1.3e-5})
                for name, t in preset.device_types.items()
            }
        }
    )
    assert _uncalibrated_hint(measured, plans[2]) is None
