"""``tessera calibrate``: measure this machine and write the cluster spec the planners read.

Parses the options, calls :func:`tessera.executor.calibrate.calibrate` (it starts the measuring
ranks) and prints what they measured; ``--out`` gets the spec, written atomically.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from tessera.cli.options import FiniteFloat, OutputFile, json_option
from tessera.cli.render import emit_json
from tessera.executor.calibrate import (
    MAX_SECONDS,
    CalibrateOptions,
    allreduce_text,
    bandwidth_text,
    bytes_text,
    flops_text,
    machine_cores,
    p2p_text,
    resolve_options,
    seconds_text,
    size_text,
)


class SpecFile(OutputFile):
    """The spec ``--out`` writes: as :class:`OutputFile`, and its folder must exist (a typo in the
    folder is refused, not created)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        folder = Path(os.path.dirname(value) or ".") if isinstance(value, str) else None
        if folder is not None and not folder.is_dir():
            self.fail(f"{click.format_filename(value)}: no such folder {str(folder)!r}", param, ctx)
        return super().convert(value, param, ctx)


@click.command()
@click.option(
    "-o",
    "--out",
    type=SpecFile(),
    default=None,
    help="Write the cluster spec (YAML) to this file, atomically; without it the spec is printed.",
)
@click.option(
    "--ranks",
    type=int,
    default=2,
    show_default=True,
    help="Devices (worker processes) to measure this machine as: 2 up to 4 per core.",
)
@click.option(
    "--threads-per-rank",
    "threads",
    type=int,
    default=None,
    help="Torch threads per rank (default: cores // ranks, at least 1).",
)
@click.option(
    "--seconds",
    type=FiniteFloat(maximum=MAX_SECONDS),
    default=10.0,
    show_default=True,
    help="Measuring budget, shared by the measurements (the workers' start-up comes on top).",
)
@json_option
def calibrate(out: str | None, ranks: int, threads: int | None, seconds: float, as_json: bool) -> None:
    """Measure this machine as RANKS CPU devices and write a cluster spec for 'tessera plan'.

    Every rank measures at the same time, as a launch's workers run: its fp32 matmul rate, memory
    bandwidth and the torch executor's cost per operator; then gloo point-to-point times between
    rank pairs (fitted as latency + bytes / bandwidth) and all-reduces. Exit codes: 0 done, 2 bad
    options, 4 a worker failed.
    """
    from tessera.executor.calibrate import calibrate as run_calibration
    from tessera.executor.calibrate import write_spec

    options = CalibrateOptions(ranks=ranks, threads=threads, seconds=seconds)
    resolve_options(options, machine_cores())  # bad values fail before any worker starts
    result = run_calibration(options)
    if out is not None:
        write_spec(result, out)
    if as_json:
        emit_json({**result.to_json(), "output": out})
        return
    click.echo(summary(result.to_json()))
    if out is not None:
        click.echo(f"wrote {out} (plan with: tessera plan MODEL --cluster {out})")
    else:
        click.echo("cluster spec (give --out FILE.yaml to write it):\n" + result.spec_yaml(), nl=False)


def summary(report: dict[str, Any]) -> str:
    """The measurements as a short table (what ``--json`` prints, for people)."""
    m, machine, spec = report["measured"], report["machine"], report["spec"]
    device = spec["device_types"]["cpu-rank"]
    link = spec["links"]["intra_node"]
    matmul, copy, per_op, p2p, reduce = m["matmul"], m["bandwidth"], m["per_op"], m["p2p"], m["allreduce"]
    rows = [
        (
            "fp32 matmul",
            f"{flops_text(matmul['flops_per_s'])} per rank",
            f"flops.fp32 {flops_text(device['flops']['fp32'])}",
        ),
        (
            "memory copy",
            f"{bandwidth_text(copy['copy_bytes_per_s'])} per rank (sum {bandwidth_text(copy['sum_bytes_per_s'])})",
            f"memory_bandwidth {bandwidth_text(device['memory_bandwidth'])}",
        ),
        (
            "executor per op",
            f"{seconds_text(per_op['forward_backward_s'])} fwd+bwd ({seconds_text(per_op['forward_s'])} fwd)",
            f"kernel_launch_overhead {seconds_text(device['kernel_launch_overhead'])}",
        ),
        (
            "decode step",
            f"{seconds_text(m['decode_op']['step_s'])} a step / {m['decode_op']['operations']} operations",
            f"decode_op_overhead {seconds_text(device.get('decode_op_overhead') or 0.0)}",
        ),
        (
            "compiled decode",
            f"{seconds_text(m['decode_op']['compiled_step_s'])} a step / {m['decode_op']['operations']} operations",
            f"decode_compiled_op_overhead {seconds_text(device.get('decode_compiled_op_overhead') or 0.0)}",
        ),
        *(
            [
                (
                    "decode exchange",
                    f"{seconds_text(m['decode_exchange'])} a gather in a step",
                    f"decode_exchange_overhead {seconds_text(device.get('decode_exchange_overhead') or 0.0)}",
                ),
                (
                    "",
                    f"+{m['decode_rank_skew']:.1%} a step, in step with the later rank",
                    f"decode_rank_skew {device.get('decode_rank_skew') or 0.0:.3g}",
                ),
            ]
            if m.get("decode_exchange")
            else []
        ),
        (
            "p2p one way",
            f"{seconds_text(p2p['latency_s'])} + bytes / {bandwidth_text(p2p['bandwidth_bytes_per_s'])}",
            f"links.intra_node.bandwidth {bandwidth_text(link['bandwidth'])}",
        ),
        (
            "p2p, computing",
            f"gloo send {seconds_text(p2p['send_s'])}, recv {seconds_text(p2p['receive_s'])}",
            f"links.intra_node.receive_overhead {seconds_text(link.get('receive_overhead', 0.0))}",
        ),
        (
            "stage workers",
            f"{seconds_text(report['measured']['pipeline']['overhead_s'])} a message sent (2-stage pipeline)",
            f"links.intra_node.overhead {seconds_text(link.get('overhead', 0.0))}",
        ),
        (
            "",
            f"{seconds_text(report['measured']['pipeline']['latency_s'])} a message's wait in a pipeline",
            f"links.intra_node.latency {seconds_text(link['latency'])}",
        ),
        (
            "",
            f"{seconds_text(report['measured']['pipeline']['action_overhead_s'])} a forward or backward",
            f"action_overhead {seconds_text(device.get('action_overhead', 0.0))}",
        ),
        (
            "",
            f"{seconds_text(report['measured']['pipeline']['contention_overhead_s'])} an action beside another rank",
            f"contention_overhead {seconds_text(device.get('contention_overhead', 0.0))}",
        ),
        (
            "",
            f"+{report['measured']['pipeline']['replica_contention']:.1%} an action beside its replica",
            f"replica_contention {device.get('replica_contention', 0.0):.3f}",
        ),
        (
            "all-reduce ring",
            f"{seconds_text(reduce['latency_s'])} + bytes / {bandwidth_text(reduce['bandwidth_bytes_per_s'])} a step",
            "links.intra_node.allreduce_*",
        ),
        (
            "",
            f"{seconds_text(report['measured']['pipeline']['allreduce_in_step_s'])} in a training step "
            f"({size_text(report['measured']['pipeline']['allreduce_bytes'])})",
            f"allreduce_overhead {seconds_text(link.get('allreduce_overhead', 0.0))}",
        ),
        (
            "memory",
            f"{bytes_text(machine['memory_total_bytes'])} in all",
            f"memory {bytes_text(device['memory'])}",
        ),
    ]
    shared = " (the ranks share cores)" if report["shares_cores"] else ""
    lines = [
        f"calibrated {machine['host']} ({machine['cores']} cores, {machine['cpu']}): {report['ranks']} ranks x "
        f"{report['threads_per_rank']} thread(s) measured at once{shared}, {report['wall_s']:.1f} s",
        f"{'measurement':<16} {'measured':<42} spec field",
        *(f"{a:<16} {b:<42} {c}" for a, b, c in rows),
        f"p2p by size: {p2p_text(p2p)}",
        f"all-reduce ({report['ranks']} ranks): {allreduce_text(reduce)}",
        f"ZeRO-1 reduce-scatter + all-gather: {p2p_text({'bytes': reduce['bytes'], 'one_way_s': reduce['zero_seconds']})}",
    ]
    if report["shares_cores"]:
        lines.append(
            f"note: {report['ranks']} ranks x {report['threads_per_rank']} thread(s) on {machine['cores']} cores: "
            f"the ranks share cores; each device counts {device['cores']} core(s)"
        )
    return "\n".join(lines)
