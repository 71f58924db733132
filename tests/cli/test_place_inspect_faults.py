"""Faults found in ``inspect``, ``place`` and ``backends`` on unusual but plausible inputs: each is a
clean answer with its documented exit code (or works), never an internal error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_runner import run_cli
from onnx import TensorProto, helper, numpy_helper

from tessera.backends.base import Backend, Capability
from tessera.backends.composite import CompositeModel, compare_outputs, random_feeds, reference_outputs
from tessera.backends.profile_cache import ProfileCache
from tessera.backends.registry import BackendRegistry
from tessera.core.errors import InputError, LaunchError
from tessera.core.graph import load_graph
from tessera.planners.placement import PlacementOptions, plan_placement
from tessera.planners.placement.plan import resolve_backends


def _f(name: str, shape: list | None, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] = (),  # type: ignore[assignment]
    *,
    opset: int = 17,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _relu(path: Path) -> Path:
    path.write_bytes(
        _model(
            [helper.make_node("Relu", ["x"], ["y"], name="r")], [_f("x", [2])], [_f("y", [2])]
        ).SerializeToString()
    )
    return path


def _place(*args: str, cache: Path) -> object:
    return run_cli("place", *args, "--backends", "onnxruntime", "--cache", str(cache))


# -- 1: external data outside the model's folder ------------------------------------------------


def _external_weight_model(path: Path, location: str) -> Path:
    """``y = x @ w`` with ``w`` stored as external data at ``location``."""
    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
    w.data_location = TensorProto.EXTERNAL
    w.ClearField("raw_data")
    w.external_data.add(key="location", value=location)
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [_f("x", [2, 2])], [_f("y", [2, 2])], [w]
    )
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("location", ["/etc/hostname", "../../etc/passwd", "sub/../../x.bin"])
def test_external_data_outside_the_model_folder_is_bad_input(tmp_path: Path, location: str) -> None:
    path = _external_weight_model(tmp_path / "ext.onnx", location)
    result = run_cli("inspect", str(path))
    assert result.code == 2, result.err
    assert str(path) in result.err and "'w'" in result.err and "outside the model's folder" in result.err
    assert len(result.err.strip().splitlines()) == 1


# -- 2: user text is never rich markup ------------------------------------------------------------


def test_markup_in_names_and_paths_is_printed_as_text(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="[/]"),
        helper.make_node("Relu", ["a"], ["b"], name="[red]left[/red]"),
        helper.make_node("Relu", ["a"], ["c"], name="[bold]right"),
        helper.make_node("Add", ["b", "c"], ["[y]"], name="[bold]end"),
    ]
    folder = tmp_path / "[red]x["
    folder.mkdir()
    path = folder / "]y.onnx"  # the path reads "…/[red]x[/]y.onnx"
    path.write_bytes(_model(nodes, [_f("x", [2])], [_f("[y]", [2])]).SerializeToString())
    result = run_cli("inspect", str(path))
    assert result.code == 0, result.err
    assert str(path) in result.out and "[/] → [bold]end" in result.out and "[y]" in result.out
    placed = run_cli(
        "place", str(path), "--backends", "onnxruntime", "--cache", str(tmp_path / "c.sqlite"),
        "-o", str(tmp_path / "p.json"), "--verify",
    )  # fmt: skip
    assert placed.code == 0, placed.err
    assert f"placed {path}" in placed.out


# -- 3: a --cache path that cannot hold a cache ------------------------------------------------


def test_cache_path_that_cannot_be_created_is_bad_input(tmp_path: Path) -> None:
    model = _relu(tmp_path / "m.onnx")
    (tmp_path / "f").write_text("a file, not a folder")
    for cache in (tmp_path / "f" / "c.sqlite", Path("/proc/tessera-test/c.sqlite")):
        result = run_cli("place", str(model), "--backends", "onnxruntime", "--cache", str(cache))
        assert result.code == 2, result.err
        assert str(cache) in result.err and "cannot create the profile cache" in result.err
        assert "corrupt" not in result.err
    with pytest.raises(InputError, match="a file is in the way"):
        ProfileCache(tmp_path / "f" / "c.sqlite").open()
    assert not list(tmp_path.glob("f*corrupt*"))


def test_empty_cache_path_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli("place", str(_relu(tmp_path / "m.onnx")), "--backends", "onnxruntime", "--cache", "")
    assert result.code == 2 and "--cache" in result.err


# -- 4: --verify and the composite executor on unusual models ----------------------------------


def test_graph_output_that_is_an_initializer_runs(tmp_path: Path) -> None:
    w = numpy_helper.from_array(np.arange(2, dtype=np.float32), "w")
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"], name="r")], [_f("x", [2])], [_f("y", [2]), _f("w", [2])], [w]
    )
    graph = load_graph(model)
    out = CompositeModel(graph, [("onnxruntime", graph.order)]).run(random_feeds(graph))
    np.testing.assert_array_equal(out["w"], np.arange(2, dtype=np.float32))
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    result = _place(str(path), "--verify", cache=tmp_path / "c.sqlite")
    assert result.code == 0, result.err


def test_string_outputs_compare_exactly(tmp_path: Path) -> None:
    same = compare_outputs({"s": np.array(["a", "b"])}, {"s": np.array(["a", "b"])})
    differ = compare_outputs({"s": np.array(["a", "c"])}, {"s": np.array(["a", "b"])})
    assert same["ok"] and not differ["ok"]
    model = _model(
        [helper.make_node("Identity", ["x"], ["y"], name="r")],
        [_f("x", [2], TensorProto.STRING)],
        [_f("y", [2], TensorProto.STRING)],
    )
    path = tmp_path / "s.onnx"
    path.write_bytes(model.SerializeToString())
    result = _place(str(path), "--verify", "--json", cache=tmp_path / "c.sqlite")
    assert result.code == 0, result.err
    assert json.loads(result.out)["plan"]["measured"]["latency_s"] is not None


@pytest.mark.parametrize(
    ("elem", "opset", "why"),
    [
        (TensorProto.FLOAT8E4M3FN, 19, "onnxruntime"),  # numpy has no such type for onnxruntime
        (TensorProto.BFLOAT16, 14, "onnxruntime"),  # no CPU Relu kernel for bf16
        (TensorProto.FLOAT, 99, "onnxruntime"),  # an opset onnxruntime does not know
    ],
)
def test_model_onnxruntime_cannot_run_is_unsupported(tmp_path: Path, elem: int, opset: int, why: str) -> None:
    op = "Identity" if elem == TensorProto.FLOAT8E4M3FN else "Relu"
    model = _model(
        [helper.make_node(op, ["x"], ["y"], name="r")],
        [_f("x", [2], elem)],
        [_f("y", [2], elem)],
        opset=opset,
    )
    model.ir_version = 10
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    result = _place(str(path), "--verify", cache=tmp_path / "c.sqlite")
    assert result.code == 2, result.err
    assert str(path) in result.err and why in result.err
    assert len(result.err.strip().splitlines()) == 1, result.err  # no native log lines


def test_model_without_operators_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.onnx"
    path.write_bytes(_model([], [_f("x", [2])], [_f("x", [2])]).SerializeToString())
    result = _place(str(path), cache=tmp_path / "c.sqlite")
    assert result.code == 2 and "no operators" in result.err


# -- 5: a plugin whose available() raises -------------------------------------------------------


class _Raising(Backend):
    name = "boom"

    def available(self) -> tuple[bool, str]:
        raise RuntimeError("driver exploded")

    def capability(self) -> Capability:
        return Capability(op_types=frozenset({"Relu"}), dtypes=frozenset({"float32"}), source="test")

    def compile(self, model):  # type: ignore[no-untyped-def]
        raise AssertionError("never built")


def test_backend_whose_available_raises_is_listed_unavailable() -> None:
    registry = BackendRegistry()
    registry.register_backend("boom", _Raising)
    (row,) = registry.report()
    assert row["available"] is False and "driver exploded" in row["reason"]
    assert registry.available() == []
    with pytest.raises(InputError, match="driver exploded"):
        resolve_backends(registry, "cpu", ["boom"])
    with pytest.raises(InputError, match="driver exploded"):
        resolve_backends(registry, "cpu", None)


# -- 6: lazy placeholder weights ---------------------------------------------------------------


def test_lazy_zoo_model_is_refused_before_measuring(tmp_path: Path) -> None:
    from tessera.core.weights import LAZY_LOCATION

    path = _external_weight_model(tmp_path / "lazy.onnx", LAZY_LOCATION)
    cache = tmp_path / "c.sqlite"
    result = _place(str(path), cache=cache)
    assert result.code == 2, result.err
    assert str(path) in result.err and "lazy parameter 'w' lacks tessera.init" in result.err
    assert ProfileCache(cache).count() == 0  # refused before any measuring


# -- 7: nothing measured -----------------------------------------------------------------------


def test_place_fails_when_nothing_could_be_measured(tmp_path: Path, monkeypatch) -> None:
    import tessera.planners.placement.plan as plan_module

    monkeypatch.setattr(plan_module, "latencies", lambda runs, **kw: {name: math.inf for name in runs})
    graph = load_graph(_relu(tmp_path / "m.onnx"))
    from tessera.backends.measure import Measurer

    with pytest.raises(LaunchError, match="nothing could be measured"):
        plan_placement(
            graph,
            PlacementOptions(backends=("onnxruntime",)),
            measurer=Measurer(ProfileCache(tmp_path / "c.sqlite")),
        )


# -- 8: subgraphs reading outer-scope tensors ---------------------------------------------------


def _if_model(*, out_of_order: bool = False) -> onnx.ModelProto:
    then = helper.make_graph([helper.make_node("Relu", ["a"], ["t"])], "then", [], [_f("t", [2])])
    other = helper.make_graph([helper.make_node("Neg", ["a"], ["e"])], "else", [], [_f("e", [2])])
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r"),
        helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
    ]
    if out_of_order:
        nodes.reverse()
    return _model(nodes, [_f("x", [2]), _f("c", [], TensorProto.BOOL)], [_f("y", [2])])


def test_if_reading_an_outer_tensor_depends_on_its_producer() -> None:
    for model in (_if_model(), _if_model(out_of_order=True)):
        graph = load_graph(model)
        assert graph.order == ("r", "if")
        assert graph.dag.has_edge("r", "if")
        assert graph.boundary(["if"]) == (["c", "a"], ["y"])
        assert graph.boundary(["r"]) == (["x"], ["a"])
        onnx.checker.check_model(graph.extract(["if"]))
        feeds = random_feeds(graph)
        split = CompositeModel(graph, [("onnxruntime", ["if"]), ("onnxruntime", ["r"])])
        assert compare_outputs(split.run(feeds), reference_outputs(graph, feeds))["ok"]


def test_inspect_sees_no_parallel_branches_in_an_if(tmp_path: Path) -> None:
    path = tmp_path / "if.onnx"
    path.write_bytes(_if_model().SerializeToString())
    result = run_cli("inspect", str(path), "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["branches"]["max_parallel_branches"] == 1


# -- 9 and 11: input shapes --------------------------------------------------------------------


def test_input_without_declared_shape_takes_input_shape(tmp_path: Path) -> None:
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="r")], [_f("x", None)], [_f("y", [2, 3])])
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    result = run_cli("inspect", str(path), "--json", "--input-shape", "x=2x3")
    assert result.code == 0, result.err
    assert json.loads(result.out)["inputs"][0]["shape"] == [2, 3]
    bare = run_cli("inspect", str(path))
    assert bare.code == 2 and "'x'" in bare.err and "--input-shape" in bare.err


def test_output_without_declared_shape_is_named(tmp_path: Path) -> None:
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="r")], [_f("x", [2])], [_f("y", None)])
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    result = run_cli("inspect", str(path))
    assert result.code == 2 and "graph output 'y'" in result.err


def test_symbolic_dim_bound_once_applies_to_every_input(tmp_path: Path) -> None:
    model = _model(
        [helper.make_node("Add", ["x", "z"], ["y"], name="a")],
        [_f("x", ["N", 3]), _f("z", ["N", 3])],
        [_f("y", ["N", 3])],
    )
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    result = run_cli("inspect", str(path), "--json", "--input-shape", "x=4x3")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert [t["shape"] for t in report["inputs"]] == [[4, 3], [4, 3]]
    assert report["defaulted_dims"] == {}
    clash = run_cli("inspect", str(path), "--input-shape", "x=4x3", "--input-shape", "z=2x3")
    assert clash.code == 2 and "'N'" in clash.err


def test_negative_top_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli("inspect", str(_relu(tmp_path / "m.onnx")), "--top", "-1")
    assert result.code == 2 and "--top" in result.err


# -- 10: backends that cannot run on the requested device ---------------------------------------


def test_backend_on_another_device_is_refused(tmp_path: Path) -> None:
    result = _place(str(_relu(tmp_path / "m.onnx")), "--device", "gpu", cache=tmp_path / "c.sqlite")
    assert result.code == 2, result.err
    assert "'onnxruntime' runs on cpu" in result.err and "--device gpu" in result.err


def test_backends_lists_a_raising_plugin_with_its_reason(monkeypatch) -> None:
    import tessera.backends.registry as registry_module

    registry = BackendRegistry()
    registry.register_backend("[red]boom[/]", _Raising)
    monkeypatch.setattr(registry_module, "default_registry", lambda **kw: registry)
    result = run_cli("backends")
    assert result.code == 0, result.err
    assert "[red]boom[/]" in result.out and "unavailable: availability check failed" in result.out
    assert "driver exploded" in result.out


# -- a reference run that would not end ----------------------------------------------------------


def _endless_loop(path: Path) -> Path:
    """``y = x + 2^62`` by a Loop adding 1 per iteration: onnxruntime runs it for centuries."""
    one = numpy_helper.from_array(np.ones(4, np.float32), "one")
    body = helper.make_graph(
        [helper.make_node("Add", ["x_in", "one"], ["x_out"]), helper.make_node("Identity", ["c_in"], ["c_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [4])],
        [one],
    )  # fmt: skip
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trip", "cond", "x"], ["y"], body=body)],
        "endless",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [
            numpy_helper.from_array(np.array(2**62, np.int64), "trip"),
            numpy_helper.from_array(np.array(True), "cond"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_reference_run_that_would_not_end_is_stopped_at_the_timeout(tmp_path: Path) -> None:
    """A Loop with trip count 2^62 hung place in its reference run; it is stopped (onnxruntime's
    terminate flag) and refused in one line, before any measuring."""
    import time

    path = _endless_loop(tmp_path / "loop.onnx")
    cache = tmp_path / "c.sqlite"
    start = time.perf_counter()
    result = _place(str(path), "--timeout", "2", cache=cache)
    assert time.perf_counter() - start < 20
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert (
        len(lines) == 1
        and f"{path}: onnxruntime's reference run of the whole model did not end within 2 s" in lines[0]
    )
    assert ProfileCache(cache).count() == 0


def test_a_cache_path_that_is_no_regular_file_is_refused_before_the_search(
    tmp_path: Path, monkeypatch
) -> None:
    """``--cache /dev/null`` was refused only after the whole search."""
    import tessera.planners.placement.plan as plan_module

    def never(*args, **kwargs):
        raise AssertionError("the search started")

    monkeypatch.setattr(plan_module, "reference_run", never)
    result = run_cli(
        "place", str(_relu(tmp_path / "m.onnx")), "--backends", "onnxruntime", "--cache", "/dev/null"
    )
    assert result.code == 2, result.err
    assert result.err.strip() == "tessera: error: /dev/null: the profile cache is not a regular file"


def test_a_place_refused_before_measuring_leaves_no_cache_file(tmp_path: Path) -> None:
    """The named cache was created before the data was read: a refused run left ``c.sqlite``."""
    model = _relu(tmp_path / "m.onnx")
    (tmp_path / "bad.npz").write_bytes(b"not an archive")
    result = _place(str(model), "--data", str(tmp_path / "bad.npz"), cache=tmp_path / "c.sqlite")
    assert result.code == 2 and "bad.npz" in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz", "m.onnx"]
