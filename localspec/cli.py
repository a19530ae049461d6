"""The `localspec` command: a click group whose commands live in localspec/commands/,
one module per command, imported only when that command runs or shows its own help.

The group's help and tab completion of command names read the short help kept here,
so `localspec --help` and completion import no command module (and so neither
llama.cpp nor the chat UI's textual): fast, and still there when the llama-cpp-python
build is broken."""

from __future__ import annotations

import importlib
import os
import sys

import click

from localspec import __version__
from localspec.core.errors import LocalspecError

# name -> (module in localspec/commands/, short help); `ls` is Ollama's name for `models`
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "Generate a reply to PROMPT (text piped on stdin: context after it)."),
    "edit": ("edit", "Rewrite FILE as the instruction says; show the diff, then write it."),
    "chat": ("chat", "Chat with a local model; see speculation at work."),
    "serve": ("serve", "OpenAI-compatible server with continuous batching and speculation."),
    "ps": ("ps", "Running `localspec serve` servers: address, model, slots, speed."),
    "bench": ("bench", "Benchmark speculative decoding here: tok/s, speedup, acceptance."),
    "tune": ("tune", "Measure V(n) and drafter costs here; store the calibration profile."),
    "stats": ("stats", "Acceptance and speed per target, draft, drafter and workload tag."),
    "models": ("models", "List known models (manifest) and local GGUF files."),
    "ls": ("models", "Same as `models` (Ollama's name)."),
    "pull": ("pull", "Download and verify models (manifest names, org/repo[:file.gguf])."),
    "doctor": ("doctor", "What this llama.cpp build supports; whether the models load."),
    "worker": ("worker", "Lend this machine's devices to other machines' localspec (RPC)."),
}


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
        module_name = COMMANDS[name][0]
        try:  # a broken llama-cpp-python install is a BackendError (core/backend/ggml.py)
            module = importlib.import_module(f"localspec.commands.{module_name}")
        except LocalspecError as exc:
            raise _Failure(str(exc), exc.exit_code) from None
        return getattr(module, module_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(map(len, COMMANDS))
        rows = [(name, click.utils.make_default_short_help(COMMANDS[name][1], limit))
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list:
        from click.shell_completion import CompletionItem

        names = [CompletionItem(name, help=COMMANDS[name][1])
                 for name in self.list_commands(ctx) if name.startswith(incomplete)]
        return [*names, *click.Command.shell_complete(self, ctx, incomplete)]  # + options

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

    Tab completion (bash): eval "$(_LOCALSPEC_COMPLETE=bash_source localspec)"
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
