"""Hostile inputs (#29): cluster specs and plans mutated at random (wrong types, out-of-range and huge
numbers, deep nesting, aliases, duplicate keys, unicode) are refused in one line naming the file,
fast, with nothing written; and the fixed cases one by one: cp plans bounded as the planner is,
device counts, a model given as a plan, a 50 MB spec, plain tables on a pipe.

Commands run in-process (:func:`run_cli`); hypothesis's examples are capped and derandomized so the
file runs in well under 30 s and the same way every time.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_runner import Result, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tessera.executor.cp_run as cp_run
from tessera.core.errors import LaunchError
from tessera.core.plans import LLM_SIZE_LIMITS, MAX_BATCH, MAX_CONTEXT
from tessera.core.specs import MAX_DEVICES

# A run that takes longer than this is a hang in the making (the slowest valid case, a plan on a
# few devices, takes well under 0.1 s in-process).
FAST_S = 5.0

TINY_LLM = {
    "name": "tiny",
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 4,
    "head_dim": 16,
    "ffn": 256,
    "vocab": 256,
    "dtype": "fp32",
}

# Every field a spec may have, so that mutations reach each of them.
BASE_SPEC: dict[str, Any] = {
    "name": "hostile",
    "device_types": {
        "gpu": {
            "kind": "gpu",
            "name": "a made-up GPU",
            "memory": "24GiB",
            "flops": {"fp32": "20TFLOPS", "fp16": "100TFLOPS"},
            "memory_bandwidth": "800GB/s",
            "kernel_launch_overhead": "5us",
        },
        "cpu": {
            "kind": "cpu",
            "cores": 2,
            "memory": "8GiB",
            "flops": {"fp32": "100GFLOPS"},
            "memory_bandwidth": "10GB/s",
        },
    },
    "nodes": [
        {"name": "node", "count": 2, "devices": [{"type": "gpu", "count": 2}]},
        {"name": "host", "count": 1, "devices": [{"type": "cpu", "count": 1}]},
    ],
    "links": {
        "intra_node": {"bandwidth": "50GB/s", "latency": "2us"},
        "inter_node": {"bandwidth": "12.5GB/s", "latency": "5us"},
        "nics": "per-node",
    },
}

HOLE = "__hostile_hole__"  # replaced by raw YAML or JSON text after dumping
DUPLICATE = "__hostile_duplicate__"  # renamed to another key of its object after dumping


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a JSON-like value (containers and leaves), the root excluded."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def _get(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


def _set(data: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


def _delete(data: Any, path: tuple[Any, ...]) -> None:
    for key in path[:-1]:
        data = data[key]
    del data[path[-1]]


# -- hostile values -----------------------------------------------------------------------------

_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)  # no lone surrogates
HOSTILE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30, 10**100, 10**400, 100_000_000, MAX_DEVICES + 1]),
    st.floats(),  # NaN and infinities included
    st.sampled_from([1e308, -1e308, 5e-324, 1e-250, 1e250, 0.5, -0.0]),  # 1e±250: the edges of a spec
    _TEXT,
    st.sampled_from(
        ["80GiB", "-5GB", "1e400TFLOPS", "0B", "abc/s", "", " ", "1e9999", "née", "💥", "\u202e"]
    ),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(_TEXT, st.integers(), max_size=3),
)

# Raw text for the hole: what a dumper would not write (deep nesting, aliases, huge literals).
_BOMB = ", ".join(
    [f"&a0 [{', '.join(['x'] * 9)}]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
)
RAW_YAML = st.sampled_from(
    [
        "[" * 5000 + "]" * 5000,  # nested too deeply
        "{a: " * 3000 + "1" + "}" * 3000,
        f"[{_BOMB}]",  # an alias bomb: 9**9 values once expanded
        "&loop [*loop]",  # a value containing itself
        "1" + "0" * 5000,  # an integer of 5001 digits
        "1e999",
        ".nan",
        "-.inf",
        "!!python/object:os.system ls",  # not safe YAML
        "!!binary aGVsbG8=",
        "&x 3",
        "'\\u0000'",
        '"\\ud800"',
    ]
)
RAW_JSON = st.sampled_from(
    [
        "[" * 100_000 + "]" * 100_000,  # nested too deeply
        '{"a": ' * 5000 + "1" + "}" * 5000,
        "1" + "0" * 5000,  # more digits than Python reads
        "1e999",  # infinity, as JSON writes no number
        "-1e999",
        "NaN",
        "Infinity",
        "10" * 30,
        "-0",
        "1.0",
        '"\\ud800"',
        '"\\u0000"',
        "true",
        "{}",
        "[]",
    ]
)


def _duplicate_a_line(text: str, index: int) -> str:
    """``text`` with one ``key: value`` line of a block mapping given twice (the same key twice in
    one mapping)."""
    lines = text.splitlines()
    candidates = [i for i, line in enumerate(lines) if ": " in line and not line.lstrip().startswith("- ")]
    if not candidates:
        return text
    i = candidates[index % len(candidates)]
    return "\n".join([*lines[: i + 1], lines[i], *lines[i + 1 :]]) + "\n"


@st.composite
def mutated_specs(draw: st.DrawFn) -> str:
    """A cluster spec's YAML text: the base spec with one to three mutations."""
    spec = copy.deepcopy(BASE_SPEC)
    raw: str | None = None
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(spec))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["value", "value", "raw", "delete", "unknown key", "unicode key"]))
        if action == "value":
            _set(spec, path, draw(HOSTILE_VALUES))
        elif action == "raw" and raw is None:
            raw = draw(RAW_YAML)
            _set(spec, path, HOLE)
        elif action == "delete":
            _delete(spec, path)
        elif action in ("unknown key", "unicode key"):
            parent = spec
            for key in path[:-1]:
                parent = parent[key]
            if isinstance(parent, dict):
                key = "memroy" if action == "unknown key" else draw(_TEXT)
                parent[key] = draw(HOSTILE_VALUES)
    text = yaml.safe_dump(spec, allow_unicode=draw(st.booleans()), sort_keys=False)
    if raw is not None:
        text = text.replace(repr(HOLE), raw).replace(HOLE, raw)
    if draw(st.integers(0, 3)) == 0:  # one time in four: more would hide the other mutations
        text = _duplicate_a_line(text, draw(st.integers(0, 10**6)))
    return text


@st.composite
def mutated_plans(draw: st.DrawFn, base: dict[str, Any]) -> str:
    """A plan's JSON text: ``base`` with one or two mutations."""
    plan = copy.deepcopy(base)
    raw: str | None = None
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(list(_paths(plan))))
        action = draw(st.sampled_from(["value", "value", "number", "raw", "delete"]))
        if action == "value":
            _set(plan, path, draw(HOSTILE_VALUES.filter(lambda v: not isinstance(v, float) or v == v)))
        elif action == "number":  # in range for some fields, beyond it for others
            _set(
                plan, path, draw(st.sampled_from([0, 1, 2, MAX_BATCH, MAX_BATCH + 1, MAX_CONTEXT + 1, 10**9]))
            )
        elif action == "raw" and raw is None:
            raw = draw(RAW_JSON)
            _set(plan, path, HOLE)
        elif action == "delete":
            _delete(plan, path)
    duplicate = None
    objects = [p for p in _paths(plan) if isinstance(_get(plan, p), dict) and _get(plan, p)]
    if objects and draw(st.integers(0, 3)) == 0:  # one object's key given twice, another value
        parent = _get(plan, draw(st.sampled_from(objects)))
        duplicate = draw(st.sampled_from(sorted(parent)))
        parent[DUPLICATE] = draw(HOSTILE_VALUES.filter(lambda v: not isinstance(v, float) or v == v))
    text = json.dumps(plan, indent=1, ensure_ascii=draw(st.booleans()))
    if raw is not None:
        text = text.replace(json.dumps(HOLE), raw)
    if duplicate is not None:
        text = text.replace(json.dumps(DUPLICATE), json.dumps(duplicate))
    return text


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder holding the tiny LLM config, the base spec and a valid cp plan; the current
    directory while the module's tests run (plans name their config relative to it)."""
    folder = tmp_path_factory.mktemp("hostile")
    old = Path.cwd()
    os.chdir(folder)
    try:
        Path("tiny.yaml").write_text(yaml.safe_dump(TINY_LLM, sort_keys=False))
        Path("base.yaml").write_text(yaml.safe_dump(BASE_SPEC, sort_keys=False))
        res = _plan_cp("base.yaml", "cp.json")
        assert res.code == 0, res.err
        yield folder
    finally:
        os.chdir(old)


def _plan_cp(spec: str, out: str, *extra: str) -> Result:
    return run_cli("plan", "--llm", "tiny.yaml", "--kind", "cp", "--cluster", spec,
                   "--batch", "4", "--context", "1K", "--output-len", "8", "-o", out, *extra)  # fmt: skip


def _timed(run: Callable[[], Result]) -> tuple[Result, float]:
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def _assert_refused_in_one_line(result: Result, path: str, *, codes: tuple[int, ...] = (2,)) -> None:
    assert result.code in codes, (result.code, result.err)
    assert "Traceback" not in result.err, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    if result.code == 2:
        assert lines[0].startswith(f"tessera: error: {path}: "), result.err


def _no_output_left(folder: Path, name: str) -> None:
    assert not (folder / name).exists()
    assert not [p.name for p in folder.iterdir() if p.name.startswith(f".{name}.")]  # temporary files


HYPOTHESIS = settings(
    max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "60")),
    deadline=None,  # each run's time is asserted below, in the test's own terms
    derandomize=not os.environ.get("HOSTILE_EXAMPLES"),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# -- property-based -----------------------------------------------------------------------------


@HYPOTHESIS
@given(text=mutated_specs())
def test_a_mutated_cluster_spec_is_planned_or_refused_in_one_line(workdir: Path, text: str) -> None:
    """exit 0 (the mutation kept the spec valid), 2 (refused: one line naming the spec), or 3 (a
    valid spec on which nothing fits, such as memory of 1 byte); never a traceback or a hang, and
    no plan file unless the plan was made."""
    spec = workdir / "mutated.yaml"
    spec.write_text(text, encoding="utf-8")
    out = workdir / "out.json"
    out.unlink(missing_ok=True)
    result, took = _timed(lambda: _plan_cp(str(spec), str(out)))
    assert took < FAST_S, f"{took:.1f} s"
    if result.code == 0:
        assert out.is_file() and json.loads(out.read_text())["kind"] == "cp"
        return
    _assert_refused_in_one_line(result, str(spec), codes=(2, 3))
    _no_output_left(workdir, "out.json")


@HYPOTHESIS
@given(data=st.data())
def test_a_mutated_cp_plan_is_valid_or_refused_in_one_line(workdir: Path, data: st.DataObject) -> None:
    """validate: exit 0 or 2 with one line naming the plan, fast. A plan that validates also passes
    or fails launch's own checks fast (workers are not started: the test stops there)."""
    base = json.loads((workdir / "cp.json").read_text())
    text = data.draw(mutated_plans(base))
    plan = workdir / "mutated.json"
    plan.write_text(text, encoding="utf-8")
    result, took = _timed(lambda: run_cli("validate", str(plan)))
    assert took < FAST_S, f"validate took {took:.1f} s"
    if result.code != 0:
        _assert_refused_in_one_line(result, str(plan))
        return

    def no_workers(*args: object, **kwargs: object) -> None:
        raise LaunchError("workers would start here")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cp_run, "launch_workers", no_workers)
        launched, took = _timed(
            lambda: run_cli("launch", str(plan), "--new-tokens", "2", "--prompt-lens", "4")
        )
    assert took < FAST_S, f"launch's checks took {took:.1f} s"
    if launched.code == 4:
        assert launched.err.strip() == "tessera: error: workers would start here", launched.err
    else:
        _assert_refused_in_one_line(launched, str(plan))


# -- the cases of #29, one by one ---------------------------------------------------------------


def _edited_plan(workdir: Path, change: Callable[[dict[str, Any]], Any]) -> Path:
    plan = json.loads((workdir / "cp.json").read_text())
    change(plan)
    path = workdir / "edited.json"
    path.write_text(json.dumps(plan))
    return path


CP_BOUNDS = {
    "a batch of 1e9": (
        lambda p: p["workload"].update(batch=10**9),
        "workload.batch 1000000000 is more than 65536 requests",
    ),
    "a degree of 1e9 without devices": (
        lambda p: [p.update(degree=10**9, kv_shards=[], cluster=None), p["workload"].pop("devices")],
        "degree 1000000000 is more than 65536 devices",
    ),
    "an output length beyond 1024M": (
        lambda p: p["workload"]["output_len"].update(max=MAX_CONTEXT + 1),
        "workload.output_len.max 1073741825 is more than 1073741824 tokens",
    ),
    "context plus output beyond 1024M": (
        lambda p: [
            p["workload"].update(context=MAX_CONTEXT),
            p["workload"]["output_len"].update(min=2, max=2),
        ],
        "a request may hold at most 1073741824",
    ),
    "output lengths the wrong way round": (
        lambda p: p["workload"]["output_len"].update(min=9),
        "workload.output_len.min 9 is more than its max 8",
    ),
    "a KV block beyond the context range": (
        lambda p: p["predicted"]["cost_model"].update(kv_block=2**40),
        "predicted.cost_model.kv_block 1099511627776 is more than",
    ),
    "a thousand-digit hidden size": (
        lambda p: p["llm"].update(hidden=10**1000),
        "llm.hidden 1000000000000000000000000000000000000... (1001 characters) is more than 1048576",
    ),
    **{
        f"llm.{key} beyond its limit": (
            lambda p, key=key, limit=limit: p["llm"].update({key: limit + 1}),
            f"llm.{key} {limit + 1} is more than {limit}",
        )
        for key, limit in LLM_SIZE_LIMITS.items()
    },
}


@pytest.mark.parametrize("case", sorted(CP_BOUNDS))
def test_a_cp_plan_is_bounded_as_the_planner_is(workdir: Path, case: str) -> None:
    """validate passed a cp plan of batch 1e9 (launch then hung building a 1e9-element list): the
    schema holds the planner's bounds; launch refuses the same plan at once."""
    change, fragment = CP_BOUNDS[case]
    path = _edited_plan(workdir, change)
    for args in (["validate", str(path)], ["launch", str(path), "--new-tokens", "2"]):
        result, took = _timed(lambda args=args: run_cli(*args))
        _assert_refused_in_one_line(result, str(path))
        assert fragment in result.err and took < FAST_S, (took, result.err)


def test_an_llm_config_is_held_to_the_plan_bounds(workdir: Path) -> None:
    """A plan the planner writes always validates: its config is held to the same limits."""
    Path("wide.yaml").write_text(yaml.safe_dump({**TINY_LLM, "hidden": LLM_SIZE_LIMITS["hidden"] + 1}))
    result = run_cli("plan", "--llm", "wide.yaml", "--kind", "cp", "--cluster", "base.yaml",
                     "--batch", "4", "--context", "1K")  # fmt: skip
    _assert_refused_in_one_line(result, "wide.yaml")
    assert "hidden: Input should be less than or equal to 1048576" in result.err


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (
            lambda s: s["nodes"][0].update(count=100_000_000),
            "nodes[0].count: 100,000,000 is more than the 65,536 devices a cluster may hold in all",
        ),
        (
            lambda s: s["nodes"][0]["devices"][0].update(count=100_000_000),
            "nodes[0].devices[0].count: 100,000,000 is more than the 65,536 devices",
        ),
        (
            lambda s: s["nodes"][0].update(count=40_000),
            "nodes[0].count: the cluster has 80,001 devices in all (40,000 node(s) x 2 device(s) in "
            "nodes[0]); tessera plans for at most 65,536",
        ),
        (lambda s: s["device_types"]["cpu"].update(cores=10**30), "device_types.cpu.cores"),
    ],
)
def test_device_counts_are_bounded(
    workdir: Path, edit: Callable[[dict[str, Any]], Any], fragment: str
) -> None:
    """count: 100000000 hung plan (devices are resolved one by one): refused at once, naming the
    field and, for the product of counts, the total."""
    spec = copy.deepcopy(BASE_SPEC)
    edit(spec)
    Path("counts.yaml").write_text(yaml.safe_dump(spec))
    result, took = _timed(lambda: _plan_cp("counts.yaml", "counts.json"))
    _assert_refused_in_one_line(result, "counts.yaml")
    assert fragment in result.err and took < FAST_S, (took, result.err)
    _no_output_left(workdir, "counts.json")


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("flops", {"fp32": 5e-324}, "flops.fp32: 4.94066e-324 FLOP/s is outside 1e-250..1e+250 FLOP/s"),
        ("memory", 10**400, "memory: a number of 401 digits is not a finite quantity"),
        ("memory", 10**300, "memory: 1e+300 bytes is outside 1..1e+250 bytes"),
        ("kernel_launch_overhead", 1e300, "kernel_launch_overhead: 1e+300 s is outside 0..1e+250 s"),
    ],
)
def test_quantities_stay_where_predictions_are_finite(
    workdir: Path, field: str, value: Any, fragment: str
) -> None:
    """A subnormal FLOP rate made every cp prediction infinite (exit 1: the plan schema refused the
    planner's own plan); a 401-digit memory size overflowed float()."""
    spec = copy.deepcopy(BASE_SPEC)
    spec["device_types"]["gpu"][field] = value
    Path("quantities.yaml").write_text(yaml.safe_dump(spec))
    result = _plan_cp("quantities.yaml", "quantities.json")
    _assert_refused_in_one_line(result, "quantities.yaml")
    assert f"device_types.gpu.{fragment}" in result.err, result.err


def test_a_large_cluster_within_the_limit_is_planned_in_seconds(workdir: Path) -> None:
    """The largest cluster allowed: 8,192 nodes of 8 GPUs (the cp planner compared all N² device
    pairs per collective: hours; now one pair of each link kind)."""
    spec = copy.deepcopy(BASE_SPEC)
    spec["nodes"] = [{"name": "node", "count": MAX_DEVICES // 8, "devices": [{"type": "gpu", "count": 8}]}]
    Path("largest.yaml").write_text(yaml.safe_dump(spec))
    result, took = _timed(lambda: run_cli("plan", "--llm", "tiny.yaml", "--kind", "cp", "--cluster",
                                          "largest.yaml", "--batch", "4", "--context", "1K"))  # fmt: skip
    assert result.code == 0 and took < 15, (took, result.err)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (lambda: "name: " + "a" * 50_000_000 + "\n", "50,000,007 bytes, more than the 1 MiB"),
        (
            lambda: (
                "name: many\ndevice_types:\n"
                + "".join(
                    f"  t{i}: {{kind: gpu, memory: 1GiB, flops: {{fp32: 1TFLOPS}}, memory_bandwidth: 1TB/s}}\n"
                    for i in range(600_000)
                )
            ),  # fmt: skip
            "more than the 1 MiB a cluster spec file may hold",
        ),
    ],
)
def test_a_50_mb_spec_is_refused_at_once(workdir: Path, body: Callable[[], str], fragment: str) -> None:
    """A 50 MB spec took 60-100 s to read (YAML at about 1 MB/s) before any check."""
    Path("huge.yaml").write_text(body())
    result, took = _timed(lambda: _plan_cp("huge.yaml", "huge.json"))
    _assert_refused_in_one_line(result, "huge.yaml")
    assert fragment in result.err and took < FAST_S, (took, result.err)


def test_many_values_without_aliases_are_not_called_an_alias_bomb() -> None:
    from tessera.core.config_files import too_large

    assert too_large({"name": list(range(20_000))}, limit=10_000) == "it holds more than 10,000 values"
    shared = list(range(100))
    assert "aliases nested inside aliases" in str(too_large({"name": [shared] * 200}, limit=10_000))


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda zoo: zoo("mmt").SerializeToString(), "validate takes a plan (this is an ONNX model)"),
        (lambda zoo: b"\x00\x01\x02binary", "validate takes a plan (this is a binary file)"),
        (lambda zoo: b"PK\x03\x04rest", "validate takes a plan (this is a zip archive)"),
        (
            lambda zoo: yaml.safe_dump(BASE_SPEC).encode(),
            "validate takes a plan (a JSON object); this text starts",
        ),
        (lambda zoo: b"", "not JSON: the file is empty"),
        (lambda zoo: b'{"kind": "cp\xff"}', "validate takes a plan (JSON text): byte 12 is not UTF-8 (0xff)"),
    ],
)
def test_a_file_that_is_no_plan_is_named_for_what_it_is(
    workdir: Path, zoo: Callable[..., Any], make: Callable[[Any], bytes], fragment: str
) -> None:
    """``tessera validate MODEL.onnx`` answered "'utf-8' codec can't decode byte 0x8a …"."""
    for name in ("model.onnx", "model.json"):  # by content, not only by name
        path = workdir / name
        path.write_bytes(make(zoo))
        result = run_cli("validate", str(path))
        _assert_refused_in_one_line(result, str(path))
        assert fragment in result.err, result.err


BOX = set("─│┃━┏┓┗┛┡┩└┘├┤┼╇╋┳┻")


def test_tables_are_plain_text_when_stdout_is_not_a_terminal(
    workdir: Path, write_model: Any, zoo: Any
) -> None:
    """The README promises plain text when stdout is piped: no box characters, no trailing blanks,
    no row wrapped at 80 columns."""
    model = write_model(zoo("mmt"))
    for args in (
        ["inspect", str(model)],
        ["zoo", "list"],
        ["plan", "--llm", "tiny.yaml", "--kind", "cp", "--cluster", "base.yaml", "--batch", "4",
         "--context", "1K", "--sweep-context", "1K,2K"],
    ):  # fmt: skip
        result = run_cli(*args)
        assert result.code == 0, result.err
        assert not BOX & set(result.out), result.out
        assert all(line == line.rstrip() for line in result.out.splitlines()), result.out
    listed = run_cli("zoo", "list").out.splitlines()
    assert any(line.startswith("mmt ") and "classifier" in line for line in listed), listed
    inspected = run_cli("inspect", str(model)).out.splitlines()
    assert any(line.split()[:2] == ["MatMul", "32"] for line in inspected), inspected
