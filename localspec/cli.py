"""The `localspec` command: a click group whose commands live in localspec/commands/,
one module per command, imported only when used (fast start-up, and the chat UI's
textual import stays out of `run`)."""

from __future__ import annotations

import importlib
import os
import sys

import click

from localspec import __version__
from localspec.core.errors import LocalspecError

COMMANDS = ("run", "edit", "chat", "serve", "bench", "tune", "stats", "models", "pull", "doctor",
            "worker")


class _Failure(click.ClickException):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _Group(click.Group):
    """Lazy subcommands; turns LocalspecError into one line on stderr and its exit code."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module = importlib.import_module(f"localspec.commands.{name}")
        return getattr(module, name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LocalspecError as exc:
            raise _Failure(str(exc), exc.exit_code) from None


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
