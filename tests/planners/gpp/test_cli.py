from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from tessera.core.errors import InfeasibleError
from tessera.core.graph import load_graph
from tessera.core.plans import check_plan_against_model, load_plan
from tessera.core.specs import ClusterSpec, load_cluster
from tessera.models import build
from tessera.planners.gpp.cli import run_gpp_plan


@pytest.fixture(scope="module")
def graph():
    return load_graph(build("candle_uno", "tiny"))


def test_run_writes_plan_gantt_and_summary(tmp_path, graph, capsys) -> None:
    cluster = load_cluster("graphpipe-v100")
    out = tmp_path / "plan.json"
    svg = tmp_path / "gantt.svg"
    plan = run_gpp_plan(graph, cluster, mini_batch=64, devices=4, output=out, gantt=svg)
    text = capsys.readouterr().out
    assert "GPP plan" in text and "SPP baseline" in text
    loaded = load_plan(out)
    assert loaded == plan
    assert check_plan_against_model(loaded, graph) == []
    assert svg.read_text().lstrip().startswith("<?xml")
    for key in ("iteration_time_s", "throughput_samples_per_s", "pipeline_depth", "bubble_fraction"):
        assert key in loaded.predicted


def test_json_and_exit_code_through_click(graph) -> None:
    cluster = load_cluster("graphpipe-v100")

    @click.command()
    @click.option("--memory-limit", default=None)
    @click.option("--json", "as_json", is_flag=True)
    def plan(memory_limit, as_json):
        try:
            run_gpp_plan(graph, cluster, mini_batch=32, devices=2, memory_limit=memory_limit, as_json=as_json)
        except InfeasibleError as exc:
            click.echo(exc.one_line(), err=True)
            raise SystemExit(exc.exit_code) from None

    runner = CliRunner()
    ok = runner.invoke(plan, ["--json"])
    assert ok.exit_code == 0
    assert json.loads(ok.output)["kind"] == "gpp"
    bad = runner.invoke(plan, ["--memory-limit", "1KiB"])
    assert bad.exit_code == 3


def test_plan_on_shared_network_interfaces(tmp_path, graph) -> None:
    # One interface per node: the plan records it, passes the checks, and its prediction comes
    # from a simulation whose inter-node transfers queue at the interfaces they cross.
    data = load_cluster("graphpipe-v100").to_json_dict()
    data["links"]["nics"] = "per-node"
    cluster = ClusterSpec.from_json_dict(data)
    out = tmp_path / "plan.json"
    plan = run_gpp_plan(graph, cluster, mini_batch=64, devices=8, output=out)
    loaded = load_plan(out)
    assert loaded == plan and loaded.cluster["links"]["nics"] == "per-node"
    assert check_plan_against_model(loaded, graph) == []
    assert loaded.predicted["throughput_samples_per_s"] > 0
