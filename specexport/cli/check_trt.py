"""check-trt: lint a bundle's ONNX graphs for TensorRT's ONNX parser, statically (the export extra: onnx)."""

from __future__ import annotations

import re
from pathlib import Path

import click

from specexport.exporter.tensorrt.lint import DEFAULT_TRT, lint_path


@click.command("check-trt")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--trt-version", default=DEFAULT_TRT, show_default=True,
              help="The oldest TensorRT the graphs must parse on (ops newer than it fail).")
def check_trt(path, trt_version):
    """Lint a bundle's ONNX graphs (or one .onnx file) against TensorRT's parser rules, with no TensorRT.

    \b
    Prints one line per violation (file, node, op type, rule), then a summary; exits 1 when any rule fails
    (warnings, such as fp32 compute, do not fail). Rules: opset 9..24 and the default domain only, ops in
    TensorRT's table, Attention without past/nonpad inputs, TensorScatter linear on axis -2, KV caches with a
    static length aliased by their present.* outputs, int4 as signed blocks of 64/128, TopK K < 3840, constant
    axes, If/Loop bodies included. A clean lint is not a built engine: see docs/gpu.md.

    \b
    Examples:
      specexport build --model smollm2-135m --method medusa --flavour trt --precision fp16 --output smol-trt
      specexport check-trt smol-trt
      specexport check-trt smol-trt/target.onnx --trt-version 11.0
    """
    if not re.fullmatch(r"\d+(\.\d+)*", trt_version):
        raise click.BadParameter(f"'{trt_version}' is not a version like 10.15", param_hint="--trt-version")
    if path.is_dir() and not any(path.glob("*.onnx")):
        raise click.ClickException(f"{path} holds no .onnx file")
    report = lint_path(path, trt_version)
    for violation in report.violations:
        click.echo(violation.line())
    click.echo(report.summary())
    if report.errors:
        raise click.exceptions.Exit(1)
