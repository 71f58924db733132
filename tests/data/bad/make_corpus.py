"""Regenerate the bad-input corpus in this folder: `python tests/data/bad/make_corpus.py`.

Each file is one way a user's input goes wrong; tests/cli/test_bad_inputs.py runs tessera on each
and checks the exit code and the one-line message. The files are committed, so the tests do not
depend on this script; it documents how each was made.
"""

from __future__ import annotations

import json
from pathlib import Path

from onnx import TensorProto, helper

HERE = Path(__file__).parent


def model(nodes, inputs, outputs, *, opset: int = 17, domains: tuple[str, ...] = ()) -> bytes:
    graph = helper.make_graph(nodes, "bad", inputs, outputs)
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    m = helper.make_model(graph, opset_imports=opsets, producer_name="tessera-corpus")
    m.ir_version = 8
    return m.SerializeToString()


def vi(name: str, shape) -> object:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def relu(shape) -> bytes:
    return model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [vi("x", shape)], [vi("y", shape)])


_SPEC_BODY = (
    "device_types:\n  cpu: {kind: cpu, memory: 8GiB, flops: {fp32: 1TFLOPS}, memory_bandwidth: 10GB/s}\n"
    "nodes:\n  - {name: n, count: 1, devices: [{type: cpu, count: 1}]}\n"
)


def _bomb(levels: int) -> str:
    """A YAML flow list whose anchors nest: level i holds nine aliases of level i - 1."""
    parts = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def main() -> None:
    good = relu([2, 3])
    files: dict[str, bytes | str] = {
        "empty.onnx": b"",
        "truncated.onnx": good[: len(good) // 2],
        "text.onnx": "this is a text file, not an ONNX model\n",
        "cycle.onnx": model(
            [
                helper.make_node("Relu", ["b"], ["a"], name="first"),
                helper.make_node("Neg", ["a"], ["b"], name="second"),
                helper.make_node("Identity", ["a"], ["y"], name="out"),
            ],
            [vi("x", [2])],
            [vi("y", [2])],
        ),
        "dangling_input.onnx": model(
            [helper.make_node("Add", ["x", "ghost"], ["y"], name="add")], [vi("x", [2])], [vi("y", [2])]
        ),
        "unknown_op.onnx": model(
            [helper.make_node("FooBar", ["x"], ["y"], name="foo")], [vi("x", [2])], [vi("y", [2])]
        ),
        "custom_domain.onnx": model(
            [helper.make_node("Fancy", ["x"], ["y"], name="fancy", domain="com.example")],
            [vi("x", [2])],
            [vi("y", [2])],
            domains=("com.example",),
        ),
        "huge_dims.onnx": relu([2**31, 2**20]),
        "negative_dim.onnx": relu([2, -3]),
        "zero_dim.onnx": relu([0, 3]),
        "not_yaml.yaml": "name: [unclosed\n  devices: {\n",
        "spec_wrong_types.yaml": (
            "name: bad\ndevice_types:\n  gpu: {kind: gpu, memory: lots, flops: {fp32: 1TFLOPS}, memory_bandwidth: 1GB/s}\n"
            "nodes:\n  - {name: n, devices: [{type: gpu}]}\n"
        ),
        "spec_missing_fields.yaml": "name: bad\nnodes:\n  - {name: n, devices: [{type: gpu}]}\n",
        "spec_zero_bandwidth.yaml": (
            "name: bad\ndevice_types:\n  gpu: {kind: gpu, memory: 16GiB, flops: {fp32: 1TFLOPS}, memory_bandwidth: 0GB/s}\n"
            "nodes:\n  - {name: n, devices: [{type: gpu}]}\n"
        ),
        "spec_zero_memory.yaml": (
            "name: bad\ndevice_types:\n  gpu: {kind: gpu, memory: 0GiB, flops: {fp32: 1TFLOPS}, memory_bandwidth: 1TB/s}\n"
            "nodes:\n  - {name: n, devices: [{type: gpu}]}\n"
        ),
        "spec_unknown_device_type.yaml": (
            "name: bad\ndevice_types:\n  gpu: {kind: gpu, memory: 16GiB, flops: {fp32: 1TFLOPS}, memory_bandwidth: 1TB/s}\n"
            "nodes:\n  - {name: n, devices: [{type: tpu}]}\n"
        ),
        "spec_duplicate_names.yaml": (
            "name: bad\ndevice_types:\n  gpu: {kind: gpu, memory: 16GiB, flops: {fp32: 1TFLOPS}, memory_bandwidth: 1TB/s}\n"
            "  gpu: {kind: gpu, memory: 32GiB, flops: {fp32: 1TFLOPS}, memory_bandwidth: 1TB/s}\n"
            "nodes:\n  - {name: n, devices: [{type: gpu}]}\n"
        ),
        "plan_not_json.json": "{ this is not json\n",
        "plan_wrong_schema_version.json": json.dumps({"schema_version": 99, "kind": "gpp"}),
        "plan_wrong_kind.json": json.dumps({"schema_version": 1, "kind": "teleport"}),
        "plan_missing_field.json": json.dumps({"schema_version": 1, "kind": "placement", "groups": []}),
        "opset99.onnx": model(
            [helper.make_node("Relu", ["x"], ["y"], name="relu")], [vi("x", [2])], [vi("y", [2])], opset=99
        ),
        # A few hundred bytes that expand to 9^9 values (nested aliases) in a string field, in an
        # integer field; an alias that contains itself; 5000 levels of nesting.
        "spec_alias_bomb_name.yaml": f"name: {_bomb(9)}\n{_SPEC_BODY}",
        "spec_alias_bomb_cores.yaml": "name: bomb\n"
        + _SPEC_BODY.replace("kind: cpu,", f"kind: cpu, cores: {_bomb(9)},"),
        "spec_recursive_alias.yaml": f"name: &loop [*loop]\n{_SPEC_BODY}",
        "spec_deep_nesting.yaml": "name: " + "[" * 5000 + "]" * 5000 + "\n" + _SPEC_BODY,
        "plan_duplicate_keys.json": '{"schema_version": 1, "kind": "gpp", "kind": "placement"}',
        "plan_deep_nesting.json": "[" * 5000 + "]" * 5000,
        "plan_huge_integer.json": '{"schema_version": ' + "9" * 5001 + "}",
    }
    files.update(plans_against_a_model())
    for name, data in files.items():
        path = HERE / name
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)


def plans_against_a_model() -> dict[str, bytes | str]:
    """Plans that parse but do not fit their model: made by planning a small chain, then broken."""
    from tessera.core.graph import load_graph
    from tessera.core.plans import dump_plan
    from tessera.core.specs import load_cluster
    from tessera.models import build
    from tessera.planners.pipeline.plan import plan_gpp
    from tessera.planners.pipeline.types import PartitionOptions

    model_bytes = build("dlrm", "tiny").SerializeToString()
    (HERE / "plan_model.onnx").write_bytes(model_bytes)
    graph = load_graph(HERE / "plan_model.onnx")
    plan, _, _ = plan_gpp(
        graph,
        load_cluster("local-cpu-split"),
        PartitionOptions(mini_batch=16, micro_batch_sizes=(8,), schedule="1f1b"),
        kind="spp",
    )
    data = json.loads(dump_plan(plan))
    data["model"]["path"] = "plan_model.onnx"  # relative to the plan's folder
    assert len(data["stages"]) == 2, "the corpus needs a two-stage plan"
    assert all(st["micro_batch_size"] == 8 for st in data["stages"]) and data["mini_batch_size"] == 16

    def variant(**changes) -> str:
        doc = json.loads(json.dumps(data))
        for path, value in changes.items():
            target = doc
            *parents, leaf = path.split("/")
            for key in parents:
                target = target[int(key) if key.isdigit() else key]
            target[int(leaf) if leaf.isdigit() else leaf] = value
        return json.dumps(doc, indent=2)

    first = data["stages"][0]
    second = data["stages"][1]
    return {
        "plan_ok.json": variant(),
        "plan_missing_model.json": variant(**{"model/path": "no_such_model.onnx"}),
        "plan_changed_model.json": variant(**{"model/sha256": "0" * 64}),
        "plan_unknown_node.json": variant(**{"stages/0/nodes": [*first["nodes"][:-1], "ghost"]}),
        "plan_unknown_device.json": variant(**{"stages/1/devices": ["node9/cpu:7"]}),
        # C1: a node in two stages; C3: one device in two stages; C4: a backward before its forward.
        "plan_breaks_c1.json": variant(**{"stages/1/nodes": [*second["nodes"], first["nodes"][0]]}),
        # C2: operators of stage 0 feed stage 1 but the plan has no edge; C5: stage 0 waits for B0
        # before F1 while stage 1 needs F1 before B0 (each schedule alone is fine: a deadlock).
        "plan_breaks_c2.json": variant(edges=[]),
        "plan_breaks_c3.json": variant(**{"stages/1/devices": first["devices"]}),
        "plan_breaks_c5.json": variant(
            **{
                "stages/0/schedule/actions": ["F0", "B0", "F1", "B1"],
                "stages/0/in_flight": 1,
                "stages/1/schedule/actions": ["F0", "F1", "B0", "B1"],
                "stages/1/in_flight": 2,
            }
        ),
        "plan_breaks_c4.json": variant(
            **{"stages/0/schedule/actions": list(reversed(first["schedule"]["actions"]))}
        ),
    }


if __name__ == "__main__":
    main()
