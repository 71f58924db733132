"""Cluster specs: loading, validation errors, presets and the resolved views (tessera.core.specs)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tessera.core.cost import allreduce_time
from tessera.core.errors import EXIT_BAD_INPUT, InputError
from tessera.core.specs import (
    DEFAULT_KERNEL_LAUNCH_OVERHEAD,
    ClusterSpec,
    Device,
    list_presets,
    load_cluster,
    parse_cluster,
    presets_dir,
)

EXPECTED_DEVICES = {
    "a5000-4x": 4,
    "dgx-a100": 8,
    "graphpipe-v100": 16,
    "h100": 1,
    "h200": 1,
    "local-cpu": 1,
    "local-cpu-split": 2,
}

BASE: dict[str, Any] = {
    "name": "test",
    "device_types": {
        "gpu": {
            "kind": "gpu",
            "memory": "16GiB",
            "flops": {"fp32": "15.7TFLOPS", "fp16": "125TFLOPS"},
            "memory_bandwidth": "900GB/s",
        }
    },
    "nodes": [{"name": "node", "count": 2, "devices": [{"type": "gpu", "count": 4}]}],
    "links": {
        "intra_node": {"bandwidth": "50GB/s", "latency": "2us"},
        "inter_node": {"bandwidth": "100Gb/s", "latency": "5us"},
    },
}


def write(tmp_path: Path, data: Any, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def load_error(path: Path | str) -> str:
    with pytest.raises(InputError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert info.value.exit_code == EXIT_BAD_INPUT
    return message


# -- presets ---------------------------------------------------------------------------------------


def test_presets_are_listed() -> None:
    assert presets_dir().is_dir()
    assert set(EXPECTED_DEVICES) <= set(list_presets())


@pytest.mark.parametrize("preset", sorted(EXPECTED_DEVICES))
def test_every_preset_loads(preset: str) -> None:
    cluster = load_cluster(preset)
    assert cluster.name == preset
    assert cluster.num_devices == EXPECTED_DEVICES[preset]
    assert len(cluster.devices()) == cluster.num_devices
    assert len({device.id for device in cluster.devices()}) == cluster.num_devices
    json.dumps(cluster.to_json_dict())


def test_every_listed_preset_has_an_expected_count() -> None:
    assert set(list_presets()) == set(EXPECTED_DEVICES), "add new presets to EXPECTED_DEVICES"


def test_preset_values_are_the_datasheet_values() -> None:
    dgx = load_cluster("dgx-a100")
    a100 = dgx.device_types["a100-80g"]
    assert a100.memory == 80 * 2**30
    assert a100.flops == {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12, "int8": 624e12}
    assert a100.memory_bandwidth == 2039e9
    assert dgx.links.intra_node is not None and dgx.links.intra_node.bandwidth == 300e9

    v100 = load_cluster("graphpipe-v100")
    assert v100.num_nodes == 4
    assert v100.links.inter_node is not None and v100.links.inter_node.bandwidth == 12.5e9  # 100 Gb/s

    h200 = load_cluster("h200").device_types["h200"]
    assert h200.memory_bandwidth == 4.8e12
    assert h200.flops["bf16"] == 989e12 and h200.flops["fp32"] == 67e12

    h100 = load_cluster("h100").device_types["h100"]
    assert h100.memory_bandwidth == 3.35e12 and h100.memory == 81559 * 2**20
    assert h100.flops["bf16"] == 989e12 and h100.flops["fp32"] == 67e12

    a5000 = load_cluster("a5000-4x").device_types["a5000"]
    assert a5000.flops["fp32"] == 27.8e12 and a5000.memory_bandwidth == 768e9


def test_load_by_path(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    for given in (path, str(path)):
        cluster = load_cluster(given)
        assert cluster.num_devices == 8
        assert cluster.num_nodes == 2
    assert load_cluster(presets_dir() / "h200.yaml") == load_cluster("h200")


def test_unknown_preset_lists_the_presets() -> None:
    message = load_error("dgx-z900")
    assert "dgx-z900" in message and "unknown cluster preset" in message
    for preset in EXPECTED_DEVICES:
        assert preset in message


# -- unreadable, not YAML, not a mapping --------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    message = load_error(tmp_path / "nope.yaml")
    assert "nope.yaml" in message and "not found" in message


def test_directory(tmp_path: Path) -> None:
    assert "directory" in load_error(tmp_path)


def test_not_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "name: [unclosed\nnodes: {\n")
    message = load_error(path)
    assert "cluster.yaml" in message and "not valid YAML" in message and "line" in message


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"name: \xff\xfe\x00")
    assert "UTF-8" in load_error(path)


@pytest.mark.parametrize(("text", "got"), [("- a\n- b\n", "list"), ("", "empty"), ("42\n", "int")])
def test_not_a_mapping(tmp_path: Path, text: str, got: str) -> None:
    message = load_error(write(tmp_path, text))
    assert "cluster.yaml" in message and "mapping" in message and got in message


def test_unsafe_yaml_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "name: !!python/object/apply:os.system ['true']\n")
    assert "not valid YAML" in load_error(path)


# -- duplicate keys ---------------------------------------------------------------------------------

DUPLICATE_DEVICE_TYPE = """\
name: dup
device_types:
  gpu: {kind: gpu, memory: 16GiB, flops: {fp32: 15.7TFLOPS}, memory_bandwidth: 900GB/s}
  gpu: {kind: gpu, memory: 32GiB, flops: {fp32: 15.7TFLOPS}, memory_bandwidth: 900GB/s}
nodes:
  - {name: node, devices: [{type: gpu}]}
"""


def test_duplicate_device_type_is_rejected(tmp_path: Path) -> None:
    message = load_error(write(tmp_path, DUPLICATE_DEVICE_TYPE))
    assert "cluster.yaml" in message and "duplicate key 'gpu'" in message and "line 4" in message


def test_duplicate_field_is_rejected(tmp_path: Path) -> None:
    text = DUPLICATE_DEVICE_TYPE.replace(
        "  gpu: {kind: gpu, memory: 32GiB", "  cpu: {kind: cpu, memory: 32GiB"
    )
    text += "name: again\n"
    assert "duplicate key 'name'" in load_error(write(tmp_path, text))


# -- invalid specs ----------------------------------------------------------------------------------


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    """Set (or, with value ``...``, delete) ``data[a][b]…`` for ``path`` ``a.b.…`` (digits index lists)."""
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    target: Any = data
    for key in keys[:-1]:
        target = target[key]
    if value is ...:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value


BAD_SPECS = [
    # (path to change, new value or ... to delete, expected path in the message, expected words)
    ("device_types.gpu.memory", ..., "device_types.gpu.memory", "required field is missing"),
    ("device_types.gpu.memory", "80 gigs", "device_types.gpu.memory", "byte size"),
    ("device_types.gpu.memory", 0, "device_types.gpu.memory", "greater than zero"),
    ("device_types.gpu.memory", "-16GiB", "device_types.gpu.memory", "negative"),
    ("device_types.gpu.memory_bandwidth", "0GB/s", "device_types.gpu.memory_bandwidth", "greater than zero"),
    ("device_types.gpu.memory_bandwidth", "900GB", "device_types.gpu.memory_bandwidth", "bandwidth"),
    ("device_types.gpu.flops.fp32", 0, "device_types.gpu.flops.fp32", "greater than zero"),
    ("device_types.gpu.flops.fp32", ".nan", "device_types.gpu.flops.fp32", "FLOP rate"),
    ("device_types.gpu.flops.fp64", "7TFLOPS", "device_types.gpu.flops", "unknown data type 'fp64'"),
    ("device_types.gpu.flops.fp32", ..., "device_types.gpu.flops", "fp32 rate is required"),
    ("device_types.gpu.kind", "tpu", "device_types.gpu.kind", "'gpu' or 'cpu'"),
    ("device_types.gpu.kernel_launch_overhead", "soon", "device_types.gpu.kernel_launch_overhead", "time"),
    ("device_types.gpu.cores", 8, "device_types.gpu", "cpu devices only"),
    (
        "device_types.gpu.memroy",
        "16GiB",
        "device_types.gpu",
        "unknown field 'memroy' (did you mean 'memory'?)",
    ),
    ("device_types.gpu", "big", "device_types.gpu", "dictionary"),
    ("device_types", {}, "device_types", "at least 1"),
    ("linkz", {}, "", "unknown field 'linkz' (did you mean 'links'?)"),
    ("name", ..., "name", "required field is missing"),
    ("name", "my cluster", "name", "no spaces"),
    ("nodes", [], "nodes", "at least 1"),
    ("nodes.0.count", 0, "nodes[0].count", "greater than or equal to 1"),
    ("nodes.0.count", True, "nodes[0].count", "integer"),
    ("nodes.0.count", "two", "nodes[0].count", "integer"),
    ("nodes.0.name", "a/b", "nodes[0].name", "no spaces, '/' or ':'"),
    ("nodes.0.devices.0.count", -4, "nodes[0].devices[0].count", "greater than or equal to 1"),
    ("nodes.0.devices.0.count", 1.5, "nodes[0].devices[0].count", "integer"),
    ("nodes.0.devices.0.type", "h100", "nodes[0].devices[0].type", "unknown device type 'h100'"),
    ("nodes.0.devices.0.typo", 1, "nodes[0].devices[0]", "unknown field 'typo'"),
    ("nodes.0.devices", [], "nodes[0].devices", "at least 1"),
    ("links.inter_node", ..., "links.inter_node", "required, the cluster has 2 nodes"),
    ("links.intra_node", ..., "links.intra_node", "required, a node holds more than one device"),
    ("links.intra_node.bandwidth", "fast", "links.intra_node.bandwidth", "bandwidth such as"),
    ("links.intra_node.bandwidth", 0, "links.intra_node.bandwidth", "greater than zero"),
    ("links.inter_node.latency", "-1us", "links.inter_node.latency", "negative"),
]


@pytest.mark.parametrize(
    ("path", "value", "field", "words"), BAD_SPECS, ids=[c[0] + "=" + repr(c[1]) for c in BAD_SPECS]
)
def test_bad_spec_names_file_and_field(tmp_path: Path, path: str, value: Any, field: str, words: str) -> None:
    data = copy.deepcopy(BASE)
    _set(data, path, value)
    text = yaml.safe_dump(data, sort_keys=False)
    if value == ".nan":  # a YAML float NaN, not the string ".nan"
        text = text.replace("'.nan'", ".nan")
    message = load_error(write(tmp_path, text, name="bad-spec.yaml"))
    assert message.startswith(f"{tmp_path / 'bad-spec.yaml'}: {field}"), message
    assert words in message, message


def test_duplicate_node_names(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["nodes"].append(copy.deepcopy(data["nodes"][0]))
    assert "nodes[1].name: duplicate node name 'node'" in load_error(write(tmp_path, data))


def test_device_type_listed_twice_in_a_node(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["nodes"][0]["devices"].append({"type": "gpu", "count": 1})
    assert "nodes[0].devices[1].type: device type 'gpu' is listed twice" in load_error(write(tmp_path, data))


def test_ambiguous_node_instance_names(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["nodes"] = [
        {"name": "n", "count": 11, "devices": [{"type": "gpu"}]},  # n0 … n10
        {"name": "n1", "count": 1, "devices": [{"type": "gpu"}]},  # n1-0
    ]
    cluster = load_cluster(write(tmp_path, data))
    assert cluster.devices()[-1].id == "n1-0/gpu:0"


def test_several_errors_are_counted(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["device_types"]["gpu"]["memory"] = "lots"
    data["device_types"]["gpu"]["memory_bandwidth"] = "quick"
    data["nodes"][0]["count"] = 0
    message = load_error(write(tmp_path, data))
    assert "device_types.gpu.memory:" in message and "(and 2 more problems)" in message


def test_parse_cluster_without_a_file() -> None:
    with pytest.raises(InputError, match=r"^plan.json: name: required field is missing$"):
        parse_cluster({k: v for k, v in BASE.items() if k != "name"}, source="plan.json")


# -- resolved views ---------------------------------------------------------------------------------

HETEROGENEOUS = """\
name: mixed
device_types:
  a100: {kind: gpu, name: NVIDIA A100-SXM4-80GB, memory: 80GiB,
         flops: {fp32: 19.5TFLOPS, bf16: 312TFLOPS}, memory_bandwidth: 2039GB/s}
  v100: {kind: gpu, memory: 16GiB, flops: {fp32: 15.7TFLOPS, fp16: 125TFLOPS},
         memory_bandwidth: 900GB/s, kernel_launch_overhead: 7us}
  xeon: {kind: cpu, cores: 16, memory: 256GiB, flops: {fp32: 2TFLOPS}, memory_bandwidth: 200GB/s}
nodes:
  - {name: fat, count: 1, devices: [{type: a100, count: 2}, {type: v100, count: 2}, {type: xeon}]}
  - {name: thin, count: 2, devices: [{type: v100, count: 1}]}
links:
  intra_node: {bandwidth: 300GB/s, latency: 2us}
  inter_node: {bandwidth: 25GB/s, latency: 5us}
"""


@pytest.fixture
def mixed(tmp_path: Path) -> ClusterSpec:
    return load_cluster(write(tmp_path, HETEROGENEOUS))


def test_heterogeneous_devices(mixed: ClusterSpec) -> None:
    ids = [device.id for device in mixed.devices()]
    assert ids == [
        "fat0/a100:0",
        "fat0/a100:1",
        "fat0/v100:0",
        "fat0/v100:1",
        "fat0/xeon:0",
        "thin0/v100:0",
        "thin1/v100:0",
    ]
    assert mixed.num_devices == 7 and mixed.num_nodes == 3
    assert [d.rank for d in mixed.devices()] == list(range(7))
    assert [d.node_index for d in mixed.devices()] == [0, 0, 0, 0, 0, 1, 2]
    assert [d.local_rank for d in mixed.devices()] == [0, 1, 2, 3, 4, 0, 0]
    xeon = mixed.device("fat0/xeon:0")
    assert xeon.type.kind == "cpu" and xeon.type.cores == 16 and xeon.type_name == "xeon"
    assert xeon.node == "fat0"


def test_kernel_launch_overhead_defaults_by_kind(mixed: ClusterSpec) -> None:
    types = mixed.device_types
    assert types["a100"].kernel_launch_overhead == DEFAULT_KERNEL_LAUNCH_OVERHEAD["gpu"] == 5e-6
    assert types["xeon"].kernel_launch_overhead == DEFAULT_KERNEL_LAUNCH_OVERHEAD["cpu"] == 1e-6
    assert types["v100"].kernel_launch_overhead == 7e-6


def test_peak_flops_falls_back_to_fp32(mixed: ClusterSpec) -> None:
    a100 = mixed.device_types["a100"]
    assert a100.peak_flops("bf16") == 312e12
    assert a100.peak_flops("int8") == 19.5e12


def test_link_between_intra_and_inter(mixed: ClusterSpec) -> None:
    devices = mixed.devices()
    intra = mixed.link_between(devices[0], devices[4])
    inter = mixed.link_between("fat0/a100:0", "thin1/v100:0")
    assert intra == mixed.links.intra_node and intra.bandwidth == 300e9
    assert inter == mixed.links.inter_node and inter.bandwidth == 25e9
    assert mixed.link_between("thin0/v100:0", "thin1/v100:0") == inter
    assert inter.transfer_time(25e9) == pytest.approx(1.0 + 5e-6)
    with pytest.raises(ValueError, match="itself"):
        mixed.link_between(devices[0], devices[0].id)
    with pytest.raises(KeyError, match="no device 'fat9/a100:0'"):
        mixed.link_between("fat9/a100:0", devices[0])


def test_link_between_on_a_preset(v100: ClusterSpec) -> None:
    first, second, fifth = v100.devices()[0], v100.devices()[1], v100.devices()[4]
    assert (first.node, fifth.node) == ("summit0", "summit1")
    assert v100.link_between(first, second).bandwidth == 50e9
    assert v100.link_between(first, fifth).bandwidth == 12.5e9


def test_devices_are_hashable_values(mixed: ClusterSpec) -> None:
    device = mixed.devices()[0]
    assert isinstance(device, Device)
    assert {device, mixed.device(device.id)} == {device}


def test_json_dict_is_resolved_and_deterministic(mixed: ClusterSpec, tmp_path: Path) -> None:
    data = mixed.to_json_dict()
    assert list(data["device_types"]) == ["a100", "v100", "xeon"]
    assert data["device_types"]["a100"]["memory"] == 80 * 2**30
    assert data["device_types"]["a100"]["flops"] == {"fp32": 19.5e12, "bf16": 312e12}
    assert data["links"]["inter_node"] == {"bandwidth": 25e9, "latency": 5e-6}
    assert data["num_devices"] == 7 and data["devices"][5]["id"] == "thin0/v100:0"
    again = load_cluster(write(tmp_path, HETEROGENEOUS, name="again.yaml")).to_json_dict()
    assert json.dumps(data) == json.dumps(again)


@pytest.mark.parametrize("preset", sorted(EXPECTED_DEVICES))
def test_json_dict_round_trips(preset: str) -> None:
    cluster = load_cluster(preset)
    data = json.loads(json.dumps(cluster.to_json_dict()))
    back = ClusterSpec.from_json_dict(data, source="plan.json")
    assert back.to_json_dict() == cluster.to_json_dict()


def test_a_links_send_and_receive_overheads_round_trip(v100: ClusterSpec) -> None:
    """Each end's own time per message (LogP's o): the sender's and the receiver's, kept apart
    through the plan's copy of the spec."""
    data = v100.to_json_dict()
    data["links"]["intra_node"] |= {"overhead": 1.8e-4, "receive_overhead": 2.4e-5}
    back = ClusterSpec.from_json_dict(data, source="plan.json")
    link = back.links.intra_node
    assert (link.overhead, link.receive_overhead) == (1.8e-4, 2.4e-5)
    assert back.to_json_dict()["links"]["intra_node"] == data["links"]["intra_node"]
    assert "receive_overhead" not in v100.to_json_dict()["links"]["intra_node"]  # unset: 0, not written


def test_a_device_types_replica_contention_round_trips_and_is_a_fraction(v100: ClusterSpec) -> None:
    """The fraction by which replicas of a data-parallel stage on one node compute slower."""
    data = v100.to_json_dict()
    (name,) = data["device_types"]
    assert "replica_contention" not in data["device_types"][name]  # unset: 0, not written
    data["device_types"][name]["replica_contention"] = 0.125
    back = ClusterSpec.from_json_dict(data, source="plan.json")
    assert back.device_types[name].replica_contention == 0.125
    assert back.to_json_dict() == data
    data["device_types"][name]["replica_contention"] = -0.1
    with pytest.raises(InputError, match="replica_contention"):
        ClusterSpec.from_json_dict(data, source="plan.json")


def test_shared_network_interfaces_round_trip(v100: ClusterSpec) -> None:
    data = v100.to_json_dict()
    assert "nics" not in data["links"]  # unset: every stage pair has a link of its own
    data["links"]["nics"] = "per-node"
    back = ClusterSpec.from_json_dict(json.loads(json.dumps(data)), source="plan.json")
    assert back.links.nics == "per-node" and back.to_json_dict()["links"]["nics"] == "per-node"
    data["links"]["nics"] = "per-rack"
    with pytest.raises(InputError, match="nics"):
        ClusterSpec.from_json_dict(data, source="plan.json")


def test_a_links_all_reduce_alpha_beta_is_optional_round_trips_and_prices_the_ring(v100: ClusterSpec) -> None:
    data = v100.to_json_dict()
    assert set(data["links"]["intra_node"]) == {"bandwidth", "latency"}  # unset: not written
    data["links"]["intra_node"].update(allreduce_bandwidth=1e9, allreduce_latency=1e-4)
    back = ClusterSpec.from_json_dict(json.loads(json.dumps(data)), source="plan.json")
    link = back.links.intra_node
    assert (link.allreduce_bandwidth, link.allreduce_latency) == (1e9, 1e-4)
    assert back.to_json_dict()["links"]["intra_node"] == data["links"]["intra_node"]
    # A ring of 4: 2·3 steps of the all-reduce latency, 2·3/4 of the bytes at its bandwidth.
    assert allreduce_time(4e6, 4, link) == pytest.approx(6 * 1e-4 + 1.5 * 4e6 / 1e9)
    plain = v100.links.intra_node
    assert allreduce_time(4e6, 4, plain) == pytest.approx(6 * plain.latency + 1.5 * 4e6 / plain.bandwidth)
