"""LLM configs (YAML, presets) and workloads (token counts, output-length distributions)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tessera.core.errors import InputError
from tessera.planners.cp.llm import list_llm_presets, load_llm_config
from tessera.planners.cp.workload import (
    MAX_BATCH,
    MAX_TOKENS,
    Workload,
    parse_output_lengths,
    parse_token_count,
    parse_token_counts,
)


def test_presets() -> None:
    assert {"llama-7b", "gpt2"} <= set(list_llm_presets())
    llama, source = load_llm_config("llama-7b")
    assert (llama.layers, llama.hidden, llama.heads, llama.ffn, llama.vocab, llama.dtype) == (
        32, 4096, 32, 11008, 32000, "fp16",
    )  # fmt: skip
    assert llama.params == pytest.approx(6.74e9, rel=0.005)
    assert llama.kv_bytes_per_token() == 32 * 2 * 4096 * 2  # 512 KiB per token
    assert source.kind == "preset" and len(source.sha256) == 64
    gpt2, _ = load_llm_config("gpt2")
    assert gpt2.params == pytest.approx(124e6, rel=0.01)


def test_config_file_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nlayers: 2\nhidden: 64\nheads: 4\nffn: 256\nvocab: 100\n")
    config, source = load_llm_config(path)
    assert (config.kv_heads, config.head_dim, config.dtype) == (4, 16, "fp16")
    assert source.kind == "file" and source.path == str(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "name: m\nlayers: 2\nhidden: 64\nheads: 4\nffn: 256\nvocab: 100\nlayrs: 3\n",
            "unknown field 'layrs'",
        ),
        ("name: m\nlayers: 0\nhidden: 64\nheads: 4\nffn: 256\nvocab: 100\n", "layers: "),
        ("name: m\nhidden: 64\nheads: 4\nffn: 256\nvocab: 100\n", "layers: required field is missing"),
        ("name: m\nlayers: 2\nhidden: 64\nheads: 4\nkv_heads: 3\nffn: 256\nvocab: 100\n", "kv_heads"),
        ("name: m\nlayers: 2\nlayers: 3\n", "duplicate key 'layers'"),
        ("name: m\nlayers: 2\nhidden: 64\nheads: 4\nffn: 256\nvocab: 100\ndtype: fp64\n", "dtype"),
        ("- a list\n", "expected an LLM config mapping"),
    ],
)
def test_config_errors_name_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as info:
        load_llm_config(path)
    assert str(path) in info.value.one_line() and "\n" not in info.value.one_line()


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(InputError, match="llama-7b"):
        load_llm_config("llama-70b")


def test_token_counts() -> None:
    assert parse_token_count("32K") == 32768
    assert parse_token_count("1M") == 1024**2
    assert parse_token_count("1000") == 1000
    assert parse_token_counts("1K,10K,1K") == [1024, 10240]
    for bad in ("0", "ten", "1.3K", "-5"):
        with pytest.raises(InputError):
            parse_token_count(bad, option="--context")


def test_output_length_distributions(tmp_path: Path) -> None:
    fixed = parse_output_lengths("256")
    assert (fixed.kind, fixed.mean, fixed.max, fixed.mean_kv_growth) == ("fixed", 256, 256, 127.5)
    uniform = parse_output_lengths("uniform:1-1K")
    assert (uniform.low, uniform.high, uniform.mean) == (1, 1024, 512.5)
    rng = np.random.default_rng(0)
    draws = uniform.sample(rng, (1000,))
    assert draws.min() >= 1 and draws.max() <= 1024
    samples = tmp_path / "lengths.txt"
    samples.write_text("# measured\n10\n\n20\n30\n")
    empirical = parse_output_lengths(f"file:{samples}")
    assert (empirical.kind, empirical.mean, empirical.max, empirical.samples) == (
        "file",
        20.0,
        30,
        (10, 20, 30),
    )
    assert set(empirical.sample(rng, (100,)).tolist()) <= {10, 20, 30}
    assert Workload(4, 1000, fixed).max_kv_length == 1256


@pytest.mark.parametrize("bad", ["uniform:5-1", "uniform:x", "normal:1-2", "0", "file:/no/such/file"])
def test_output_length_errors(bad: str) -> None:
    with pytest.raises(InputError, match="--output-len"):
        parse_output_lengths(bad)


def test_output_length_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("10\nabc\n")
    with pytest.raises(InputError, match="line 2"):
        parse_output_lengths(f"file:{path}")


def test_token_counts_are_bounded() -> None:
    assert parse_token_count("1024M") == MAX_TOKENS == 2**30
    for bad in ("1025M", "99999999999999999999", "9" * 400, "1073741825"):
        with pytest.raises(InputError, match=r"--context: token counts must be in 1\.\.1073741824"):
            parse_token_count(bad, option="--context")
    with pytest.raises(InputError, match="--output-len"):
        parse_output_lengths("uniform:1-99999999999999")


def test_uniform_moments_in_closed_form() -> None:
    """The mean square of uniform:A-B is Σn²/(B-A+1), not a mean over an array of every length."""
    small = parse_output_lengths("uniform:3-4096")
    n = np.arange(3, 4097, dtype=np.float64)
    assert small.mean_square == float(np.mean(n * n))
    huge = parse_output_lengths("uniform:1-1024M")  # 2**30 lengths: 8 GiB as an array
    top = 2**30
    assert huge.mean_square == (top + 1) * (2 * top + 1) / 6
    assert huge.mean_kv_growth == pytest.approx(top / 3, rel=1e-6)


def test_output_length_file_lines_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("10\n12345678901234567890123\n")
    with pytest.raises(InputError, match="line 2: output lengths must be in 1..1073741824"):
        parse_output_lengths(f"file:{path}")
    path.write_text("007\n1073741824\n")
    assert parse_output_lengths(f"file:{path}").samples == (7, 2**30)


def test_workload_batch_is_bounded() -> None:
    assert Workload(MAX_BATCH, 1).batch == 65536
    for bad in (0, MAX_BATCH + 1, 10**23):
        with pytest.raises(InputError, match=r"--batch: must be in 1\.\.65536"):
            Workload(bad, 1024)
    with pytest.raises(InputError, match="--context"):
        Workload(1, MAX_TOKENS + 1)


def test_the_plan_schema_takes_every_dtype_and_context_the_planner_makes() -> None:
    from tessera.core.plans import LLM_DTYPES, MAX_CONTEXT
    from tessera.planners.cp.llm import DTYPE_BYTES
    from tessera.planners.cp.workload import MAX_TOKENS

    assert tuple(DTYPE_BYTES) == LLM_DTYPES and MAX_TOKENS == MAX_CONTEXT
