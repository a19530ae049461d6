"""`localspec run`: prompt from arguments and stdin, text streamed to stdout."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click
from click.core import ParameterSource

from localspec.commands.options import (
    LoadOptions,
    MemoryOptions,
    gen_config,
    gen_options,
    grammar_options,
    grammar_text,
    load_options,
    log_options,
    memory_config,
    memory_options,
    model_options,
    sampling_config,
    sampling_options,
    spec_config,
    spec_options,
)
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.errors import UsageError
from localspec.core.events import TRUNCATED, Done, GenerationStats, Token, Transcript


def read_prompt(args: tuple[str, ...], prompt: str | None = None, file: str | None = None) -> str:
    """The prompt (the arguments, -p TEXT or -f FILE: one of them), then stdin (when it
    is not a terminal) as context after it."""
    given = [name for name, v in (("PROMPT", args), ("-p", prompt), ("-f", file)) if v]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} both give the prompt: give one")
    if file is not None:
        prompt = _read_prompt_file(file)
    parts = [prompt] if prompt else [" ".join(args)] if args else []
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        if piped.strip():
            parts.append(piped)
    text = "\n\n".join(p for p in parts if p)
    if not text.strip():
        raise UsageError("no prompt: give one as an argument or on stdin")
    return text


def _read_prompt_file(path: str) -> str:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"-f: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return text.removesuffix("\n")  # as llama.cpp's -f: the file's last newline is not prompt


def models_named_first(args: tuple[str, ...]) -> list[str]:
    """The names `localspec models` lists for the prompt's first word, when that word
    looks like a model name (Ollama's `run MODEL PROMPT` habit): the word itself for a
    file or store name, else the listed names it is or begins (exact and downloaded
    first); empty when it does not look like one."""
    if not args:
        return []
    word = args[0].strip()
    if len(word) < 4 or any(c.isspace() for c in word):
        return []
    if word.lower().endswith(".gguf") or word.split(":", 1)[0] in ("ollama", "lmstudio", "llama.cpp"):
        return [word]
    if not any(c.isdigit() or c in "-.:/_" for c in word):
        return []  # a plain word ("explain", "write") is a prompt, even if a name contains it
    from localspec.models import list_models

    key = word.lower()
    hits = []
    for row in list_models(header=False):
        name = row.name.lower()
        if name == key or row.filename.lower().removesuffix(".gguf") == key:
            hits.append((0, row.path is None, row.name))
        elif name.startswith((key + "-", key + ":")):
            hits.append((1, row.path is None, row.name))
    return list(dict.fromkeys(name for *_, name in sorted(hits)))


def _model_first_message(prompt: tuple[str, ...], named: list[str]) -> str:
    which = "" if named == [prompt[0]] else f" ({', '.join(named)})"
    if len(prompt) == 1:  # Ollama's `run MODEL` is a conversation
        return (f"'{prompt[0]}' names a model{which} and would be sent as the prompt; choose the model "
                f"with -m: localspec run -m {named[0]} \"PROMPT\", or localspec chat -m {named[0]} "
                f"(to send the word as text: -p {prompt[0]})")
    return (f"'{prompt[0]}' names a model{which} but would be sent as the start of the prompt; choose "
            f"the model with -m: localspec run -m {named[0]} \"{' '.join(prompt[1:])}\" (to send it "
            f"as text: -p \"{' '.join(prompt)}\")")


def stats_line(stats: GenerationStats) -> str:
    """One human line: speed, acceptance, mean accepted length."""
    parts = [
        f"{stats.generated} tokens",
        f"{stats.tokens_per_s:.1f} tok/s",
        f"prefill {stats.prefill_tokens} tok in {stats.prefill_s:.2f}s",
        f"drafter {stats.drafter}",
    ]
    if stats.drafted:
        parts += [
            f"acceptance {stats.acceptance:.0%} ({stats.accepted}/{stats.drafted})",
            f"mean accepted {stats.mean_accepted:.2f}",
            f"{stats.tokens_per_round:.2f} tok/round",
        ]
    return " | ".join(parts) + f" | stop: {stats.stop_reason}"


def print_stats(stats: GenerationStats, fmt: str | None) -> None:
    if fmt == "json":
        click.echo(json.dumps(stats.to_dict()), err=True)
    elif fmt in ("text", "policy"):
        click.echo(stats_line(stats), err=True)
    if fmt == "policy":
        for choice, row in stats.policy.items():
            click.echo(f"  {choice:>10}: {row['rounds']:4d} rounds, expected {row['expected']:.2f}"
                       f" tokens/round, realised {row['realised']:.2f}", err=True)


def run_generation(
    opts: LoadOptions,
    spec: SpecConfig,
    sampling: SamplingConfig,
    gen: GenerationConfig,
    text: str,
    *,
    system: str | None,
    raw: bool,
    stats_format: str | None,
    tag: str | None = None,
    log: bool = True,
    memory: MemoryOptions = MemoryOptions(),
) -> GenerationStats | None:
    """Load, generate, stream to stdout. Ctrl-C stops and keeps what was printed."""
    # imported here: they load llama.cpp, which `localspec run --help` must not need
    from localspec.core.engine import generate
    from localspec.core.chat_template import chat_prompt
    from localspec.runtime import log_run, make_drafter, open_runtime
    from localspec.memory_store import open_memory

    with open_runtime(opts, want_draft=spec.mode.uses_draft_model) as rt:
        target = rt.target
        prompt = target.tokenize(text) if raw else chat_prompt(target, text, system)
        recall = (open_memory(target, enabled=memory.enabled, lookup=memory.lookup)
                  if spec.mode.uses_memory else None)
        drafter = make_drafter(spec, sampling, rt.draft, target=target, memory=recall)
        reply = Transcript(generate(target, prompt, drafter, sampling=sampling, spec=spec, gen=gen,
                                    draft_model=rt.draft))
        out = sys.stdout
        try:
            with reply:  # closed first: the engine's finally leaves the KV cache consistent
                for ev in reply:
                    if isinstance(ev, Token) and ev.text:
                        out.write(ev.text)
                        out.flush()
                    elif isinstance(ev, Done):
                        out.write(ev.text)
        except KeyboardInterrupt:
            out.write("\n")
            out.flush()
            click.echo("interrupted", err=True)
            raise SystemExit(130) from None
        if reply.text and not reply.text.endswith("\n"):
            out.write("\n")
        out.flush()
        stats = reply.stats
        if stats is not None:
            if gen.grammar and stats.stop_reason in TRUNCATED:
                click.echo(f"warning: the output stopped ({stats.stop_reason}) before the grammar "
                           "was complete; raise -n", err=True)
            print_stats(stats, stats_format)
        log_run("run", stats, target, rt.draft, spec, sampling, tag=tag, prompt_text=text,
                output_text=reply.text, enabled=log)
        return stats


@click.command()
@click.argument("prompt", nargs=-1)
@model_options(auto_draft=True)
@spec_options
@sampling_options
@gen_options()
@grammar_options
@click.option("-p", "--prompt", "prompt_text", default=None, metavar="TEXT",
              help="the prompt, as llama.cpp's -p (instead of PROMPT arguments)")
@click.option("-f", "--file", "prompt_file", default=None, metavar="FILE",
              help="read the prompt from FILE ('-': stdin), as llama.cpp's -f")
@click.option("-sys", "--system", "--system-prompt", "system", default=None,
              help="system message for the chat template")
@click.option("--raw", is_flag=True, help="send the text as is, without the chat template")
@click.option("--stats", "stats_format", type=click.Choice(["text", "json", "policy"]),
              default="text", show_default=True,
              help="stats on stderr: one line, a JSON record, or the line plus how often the auto "
                   "policy chose each drafter and k (expected vs realised tokens per round)")
@click.option("-q", "--quiet", is_flag=True, help="print no stats")
@log_options
@memory_options
@click.pass_context
def run(ctx: click.Context, prompt: tuple[str, ...], prompt_text: str | None, prompt_file: str | None,
        system: str | None, raw: bool, stats_format: str, quiet: bool, tag: str | None, no_log: bool,
        **kw) -> None:
    """Generate a reply to PROMPT; text piped on stdin is appended as context.

    \b
      git diff | localspec run "write a commit message"
      localspec run --raw "def fib(n):" -n 64
      localspec run -m qwen2.5-coder-0.5b -f question.txt
      localspec run --json-schema person.json "Alice, 30, likes chess"
    """
    if ctx.get_parameter_source("model") == ParameterSource.DEFAULT:
        named = models_named_first(prompt)
        if named:
            raise UsageError(_model_first_message(prompt, named))
    opts = load_options(kw, ctx.obj["verbose"])
    memory = memory_config(kw)
    spec = spec_config(kw, has_draft=bool(opts.draft and opts.draft.lower() != "none"))
    gen = replace(gen_config(kw), grammar=grammar_text(kw))
    text = read_prompt(prompt, prompt_text, prompt_file)
    run_generation(
        opts, spec, sampling_config(kw), gen, text,
        system=system, raw=raw, stats_format=None if quiet else stats_format,
        tag=tag, log=not no_log, memory=memory,
    )
