"""The plan schemas (tessera.core.plans): every kind round-trips to the same bytes, a malformed plan is
refused in one line naming its field, and a plan is checked against the model it names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tessera.backends.measure import Measurer
from tessera.backends.profile_cache import ProfileCache
from tessera.core.errors import EXIT_BAD_INPUT, InputError
from tessera.core.graph import load_graph
from tessera.core.plan_checks import check_plan_against_model, problems_error
from tessera.core.plans import (
    CpPlan,
    GppPlan,
    ModelRef,
    PlacementPlan,
    Plan,
    dump_plan,
    load_plan,
    parse_plan,
    write_plan,
)
from tessera.models import build
from tessera.planners.cp.llm import load_llm_config
from tessera.planners.cp.plan import plan_cp
from tessera.planners.cp.recognize import recognize_llm
from tessera.planners.cp.workload import Workload
from tessera.planners.pipeline.plan import plan_gpp
from tessera.planners.pipeline.types import PartitionOptions
from tessera.planners.placement import PlacementOptions, plan_placement


@pytest.fixture(scope="module")
def gpp_plan(v100, zoo_graph) -> GppPlan:
    plan, _, _ = plan_gpp(zoo_graph("mmt"), v100, PartitionOptions(mini_batch=8))
    return plan


@pytest.fixture(scope="module")
def placement_plan(zoo_graph, tmp_path_factory) -> PlacementPlan:
    cache = ProfileCache(tmp_path_factory.mktemp("profiles") / "profiles.sqlite")
    options = PlacementOptions(backends=("onnxruntime",), rounds=1)
    return plan_placement(zoo_graph("candle_uno"), options, measurer=Measurer(cache)).plan


@pytest.fixture(scope="module")
def cp_plan(cluster) -> CpPlan:
    """A cp plan of an LLM config (``--llm gpt2``): no ONNX model behind it."""
    llm, source = load_llm_config("gpt2")
    return plan_cp(llm, cluster("a5000-4x"), Workload(8, 1024), source=source, layers=1)


@pytest.fixture(scope="module")
def plans(placement_plan, gpp_plan, cp_plan) -> dict[str, Plan]:
    return {"placement": placement_plan, "gpp": gpp_plan, "cp": cp_plan}


def _data(plan: Plan) -> dict[str, Any]:
    """The plan as the JSON document a file holds, to edit (a fresh copy every call)."""
    return json.loads(dump_plan(plan))


def _refusal(data: Any) -> str:
    with pytest.raises(InputError) as info:
        parse_plan(data, label="plan.json")
    assert info.value.exit_code == EXIT_BAD_INPUT
    message = str(info.value)
    assert "\n" not in message and message.startswith("plan.json: "), message
    return message


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["placement", "gpp", "cp"])
def test_dump_then_parse_gives_the_same_bytes(plans, kind: str) -> None:
    plan = plans[kind]
    text = dump_plan(plan)
    again = parse_plan(json.loads(text), label="plan.json")
    assert type(again) is type(plan) and again.kind == kind
    assert again == plan
    assert dump_plan(again) == text


@pytest.mark.parametrize("kind", ["placement", "gpp", "cp"])
def test_write_then_load_gives_the_plan(plans, kind: str, tmp_path: Path) -> None:
    path = write_plan(plans[kind], tmp_path / "plan.json")
    assert load_plan(path) == plans[kind]
    assert path.read_text(encoding="utf-8") == dump_plan(plans[kind])


def test_an_spp_plan_round_trips_as_its_own_kind(v100, zoo_graph) -> None:
    plan, _, _ = plan_gpp(zoo_graph("gpt"), v100, PartitionOptions(mini_batch=8), kind="spp")
    again = parse_plan(json.loads(dump_plan(plan)), label="plan.json")
    assert isinstance(again, GppPlan) and again.kind == "spp"
    assert dump_plan(again) == dump_plan(plan)


def test_the_plans_fit_their_models(plans, zoo_graph) -> None:
    assert check_plan_against_model(plans["placement"], zoo_graph("candle_uno")) == []
    assert check_plan_against_model(plans["gpp"], zoo_graph("mmt")) == []


# -- schema refusals -------------------------------------------------------------------------------


def test_a_plan_is_a_json_object_of_a_known_version_and_kind(gpp_plan) -> None:
    assert "a plan must be a JSON object" in _refusal([_data(gpp_plan)])
    data = _data(gpp_plan)
    data["schema_version"] = 2
    assert "schema_version 2 is not supported (this tessera reads version 1)" in _refusal(data)
    data = _data(gpp_plan)
    data["kind"] = "pipeline"
    message = _refusal(data)
    assert "kind 'pipeline' is not a plan kind" in message and "placement, gpp, spp, cp" in message
    del data["kind"]
    assert "kind None is not a plan kind" in _refusal(data)


def test_a_body_of_another_kind_is_refused(gpp_plan) -> None:
    data = _data(gpp_plan)
    data["kind"] = "placement"  # a pipeline's stages under the placement schema
    message = _refusal(data)
    assert "field groups: Field required" in message and "more)" in message


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda d: d.pop("mini_batch_size"), "field mini_batch_size: Field required"),
        (lambda d: d["stages"][0].pop("memory"), "field stages.0.memory: Field required"),
        (lambda d: d.update(colour="red"), "field colour: Extra inputs are not permitted"),
        (
            lambda d: d["stages"][0]["memory"].update(peak_gib=1.0),
            "field stages.0.memory.peak_gib: Extra inputs are not permitted",
        ),
        (
            lambda d: d["stages"][0]["memory"].update(peak=-1),
            "field stages.0.memory.peak: Input should be greater than or equal to 0",
        ),
        (lambda d: d.update(mini_batch_size=0), "field mini_batch_size: Input should be greater than 0"),
        (
            lambda d: d["stages"][0].update(micro_batch_size=-8),
            "field stages.0.micro_batch_size: Input should be greater than 0",
        ),
        (lambda d: d.update(mini_batch_size="8"), "field mini_batch_size: Input should be a valid integer"),
        (
            lambda d: d["predicted"].update(iteration_time_s=-1.0),
            "predicted.iteration_time_s is -1.0: predictions are finite and not negative",
        ),
        (lambda d: d["model"].update(sha256="abc"), "field model.sha256: String should match pattern"),
        (lambda d: d["model"].update(rewrites=["fuse-all"]), "field model.rewrites"),
        (lambda d: d["stages"][0].update(id=7), "field plan: stage ids must be 0.."),
    ],
    ids=[
        "missing",
        "missing-nested",
        "extra",
        "extra-nested",
        "negative-bytes",
        "zero-mini-batch",
        "negative-micro-batch",
        "text-for-integer",
        "negative-prediction",
        "sha256",
        "unknown-rewrite",
        "stage-ids",
    ],
)
def test_a_malformed_gpp_plan_is_refused_naming_the_field(gpp_plan, edit, fragment: str) -> None:
    data = _data(gpp_plan)
    edit(data)
    assert fragment in _refusal(data)


@pytest.mark.parametrize("action", ["X0", "F", "F01", "B-1", "f0", "F0 ", "1F0", "F1234567890"])
def test_a_schedule_action_must_read_like_F3_or_B3(gpp_plan, action: str) -> None:
    data = _data(gpp_plan)
    data["stages"][0]["schedule"]["actions"][0] = action
    message = _refusal(data)
    assert "field stages.0.schedule.actions.0: String should match pattern" in message


def test_an_unknown_schedule_kind_is_refused(gpp_plan) -> None:
    data = _data(gpp_plan)
    data["stages"][0]["schedule"]["kind"] = "zigzag"
    message = _refusal(data)
    assert "field stages.0.schedule.kind: Input should be '1f1b', 'kfkb', 'greedy' or 'gpipe'" in message


def test_several_faults_name_the_first_and_count_the_rest(gpp_plan) -> None:
    data = _data(gpp_plan)
    del data["mini_batch_size"]
    data["stages"][0]["memory"]["peak"] = -1
    data["stages"][0]["colour"] = "red"
    assert _refusal(data).endswith("(and 2 more)")


def test_a_placement_group_id_is_used_once(placement_plan) -> None:
    data = _data(placement_plan)
    data["groups"].append({**data["groups"][0]})
    assert f"group id {data['groups'][0]['id']} is used twice" in _refusal(data)
    data["groups"] = []
    assert "field groups: List should have at least 1 item" in _refusal(data)


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda d: d.update(strategy="pp"), "field strategy: Input should be 'cp', 'tp', 'dp' or 'cp+tp'"),
        (lambda d: d["llm"].update(kv_heads=5), "llm.kv_heads 5 must divide llm.heads"),
        (lambda d: d["llm"].update(layers=0), "llm.layers must be a positive integer, got 0"),
        (lambda d: d["workload"].update(batch=-1), "workload.batch must be a positive integer, got -1"),
        (lambda d: d.pop("llm_config"), "a cp plan names exactly one of model (ONNX) and llm_config"),
        (lambda d: d["kv_shards"][0].update(start=-16), "field kv_shards.0.start: Input should be greater"),
        (lambda d: d["kv_shards"].pop(), "a plan of degree 4 has 3 kv_shards"),
    ],
    ids=["strategy", "kv-heads", "layers", "batch", "no-source", "negative-shard", "shards"],
)
def test_a_malformed_cp_plan_is_refused_naming_the_field(cp_plan, edit, fragment: str) -> None:
    data = _data(cp_plan)
    edit(data)
    assert fragment in _refusal(data)


def test_load_plan_names_the_file_and_what_is_wrong(tmp_path: Path, gpp_plan) -> None:
    missing = tmp_path / "nowhere.json"
    with pytest.raises(InputError, match="no such plan file") as info:
        load_plan(missing)
    assert info.value.source == str(missing)
    path = tmp_path / "plan.json"
    path.write_text("{", encoding="utf-8")
    with pytest.raises(InputError, match=r"not JSON: .* at line 1 column 2"):
        load_plan(path)
    path.write_text(dump_plan(gpp_plan).replace('"predicted": {', '"predicted": {"nan": NaN, ', 1))
    with pytest.raises(InputError, match="NaN is not a JSON value"):
        load_plan(path)


# -- the plan against its model -------------------------------------------------------------------


def test_a_changed_model_is_named_by_its_sha256(gpp_plan) -> None:
    other = load_graph(build("mmt", "tiny", seed=1))  # the same operators, other weights
    problems = check_plan_against_model(gpp_plan, other)
    assert problems == [
        f"model changed: the plan was made for sha256 {gpp_plan.model.sha256[:12]}…, "
        f"the model is {other.sha256[:12]}…"
    ]


@pytest.mark.parametrize("kind", ["placement", "gpp"])
def test_an_unknown_node_is_named(plans, zoo_graph, kind: str) -> None:
    plan, graph = plans[kind], zoo_graph("candle_uno" if kind == "placement" else "mmt")
    data = _data(plan)
    parts = data["groups"] if kind == "placement" else data["stages"]
    first = parts[0]["nodes"][0]
    parts[0]["nodes"][0] = "nowhere/matmul"
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    assert "group/stage 0 names unknown node 'nowhere/matmul'" in problems
    assert f"1 node(s) not covered by any group/stage, first {first!r}" in problems


@pytest.mark.parametrize("kind", ["placement", "gpp"])
def test_a_node_in_two_groups_is_named(plans, zoo_graph, kind: str) -> None:
    plan, graph = plans[kind], zoo_graph("candle_uno" if kind == "placement" else "mmt")
    data = _data(plan)
    parts = data["groups"] if kind == "placement" else data["stages"]
    if len(parts) == 1:  # one group: split it so that a node can be in two
        parts.append({**parts[0], "id": parts[0]["id"] + 1, "nodes": parts[0]["nodes"][-1:]})
        parts[0]["nodes"] = parts[0]["nodes"][:-1]
    node = parts[0]["nodes"][0]
    parts[-1]["nodes"].append(node)
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    assert f"node {node!r} is in both group/stage 0 and {len(parts) - 1}" in problems


@pytest.mark.parametrize("kind", ["placement", "gpp"])
def test_an_uncovered_node_is_named(plans, zoo_graph, kind: str) -> None:
    plan, graph = plans[kind], zoo_graph("candle_uno" if kind == "placement" else "mmt")
    data = _data(plan)
    parts = data["groups"] if kind == "placement" else data["stages"]
    part = next(p for p in parts if len(p["nodes"]) > 1)
    dropped = part["nodes"].pop()
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    assert f"1 node(s) not covered by any group/stage, first {dropped!r}" in problems


def test_a_wrong_node_count_is_named(gpp_plan, zoo_graph) -> None:
    graph = zoo_graph("mmt")
    data = _data(gpp_plan)
    data["model"]["num_nodes"] += 1
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    assert f"model.num_nodes is {graph.num_nodes + 1}; the model has {graph.num_nodes} operators" in problems


def test_a_cp_plan_of_an_llm_config_names_no_model(cp_plan, zoo_graph) -> None:
    assert check_plan_against_model(cp_plan, zoo_graph("gpt")) == [
        "the plan was made from an LLM config (llm_config), not from an ONNX model"
    ]


def test_a_cp_plan_of_an_onnx_model_is_checked_against_it(cluster, zoo_graph) -> None:
    graph = zoo_graph("gpt")
    plan = plan_cp(recognize_llm(graph), cluster("a5000-4x"), Workload(2, 8), model=ModelRef.of(graph))
    assert check_plan_against_model(plan, graph) == []
    assert check_plan_against_model(plan, zoo_graph("bert"))[0].startswith("model changed: ")
    data = _data(plan)
    devices = [f"elsewhere/gpu:{i}" for i in range(plan.degree)]
    data["workload"]["devices"] = devices
    for shard, device in zip(data["kv_shards"], devices, strict=True):
        shard["device"] = device
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    assert problems == [f"device {d!r} is not in the plan's cluster" for d in devices]
    data = _data(plan)
    memory = data["predicted"]["memory_per_device"]
    memory["total"] = memory["capacity"] + 1
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), graph)
    assert f"predicted memory per device {memory['total']} bytes exceeds its capacity" in problems[0]


# -- problems as one error -------------------------------------------------------------------------


def test_problems_error_is_one_line_with_how_many_more() -> None:
    problems = ["group/stage 0 names unknown node 'x'", "node 'y' is in both group/stage 0 and 1", "z"]
    error = problems_error(problems, "plan.json")
    assert isinstance(error, InputError) and error.exit_code == EXIT_BAD_INPUT
    assert str(error) == "plan.json: group/stage 0 names unknown node 'x' (and 2 more)"
    assert error.problems == problems  # every one, for validate --json
    one = problems_error(problems[:1], "plan.json")
    assert str(one) == "plan.json: group/stage 0 names unknown node 'x'" and "more" not in str(one)


def test_problems_error_of_a_real_plan(gpp_plan, zoo_graph) -> None:
    data = _data(gpp_plan)
    data["stages"][0]["nodes"][0] = "nowhere/matmul"
    problems = check_plan_against_model(parse_plan(data, label="plan.json"), zoo_graph("mmt"))
    error = problems_error(problems, "plan.json")
    assert "\n" not in str(error)
    assert str(error) == f"plan.json: {problems[0]} (and {len(problems) - 1} more)"
