"""`localspec chat`: parse options, load the models, run the app (or the line REPL when
stdin or stdout is not a terminal)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from localspec import models
from localspec.commands.options import (
    gen_config,
    gen_options,
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


@click.command()
@model_options(auto_draft=True)
@spec_options
@sampling_options
@gen_options(default_max=512)
@click.option("-sys", "--system", "--system-prompt", "system", default=None, help="system message")
@click.option("--session", "session_file", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="resume from FILE if it exists, and save each turn to it "
                                 "(.md: markdown, else JSON)")
@click.option("--plain", is_flag=True, help="line REPL even on a terminal")
@click.option("--no-prompt-cache", is_flag=True,
              help="re-prefill the whole conversation every turn (to measure what the cache saves)")
@log_options
@memory_options
@click.pass_context
def chat(ctx: click.Context, system: str | None, session_file: Path | None, plain: bool,
         no_prompt_cache: bool, tag: str | None, no_log: bool, **kw) -> None:
    """Chat with a local model; see speculation at work.

    \b
    Draft-sourced tokens are highlighted (F2 toggles), F3 switches markdown/raw,
    Esc stops a reply, /help lists the commands. Without --model, the default target
    (qwen2.5-coder-1.5b); --draft auto (the default) drafts with the best compatible
    smaller model on disk (the 0.5B for it), --draft none with n-grams only.
    Without a terminal it reads one prompt per line and writes one reply per line:
      echo "hi" | localspec chat -n 32
    """
    from localspec.chat.runner import ChatRunner
    from localspec.chat.session import Conversation
    from localspec.runtime import open_runtime

    verbose = bool((ctx.find_root().obj or {}).get("verbose"))
    tty = sys.stdin.isatty() and sys.stdout.isatty() and not plain
    opts = load_options(kw, verbose)
    memory = memory_config(kw)
    has_draft = bool(opts.draft) and opts.draft.lower() != "none"
    spec = spec_config(kw, has_draft=has_draft)
    sampling, gen = sampling_config(kw), gen_config(kw)
    conv = Conversation()
    if session_file is not None and session_file.exists():
        conv = Conversation.load(session_file)
    if system is not None:
        conv.system = system or None
    if tty:
        click.echo(f"loading {opts.model or models.load_manifest().default_target}"
                   + (f" and {opts.draft}" if has_draft and opts.draft.lower() != "auto" else "")
                   + " ...", err=True)
    with open_runtime(opts, want_draft=spec.mode.uses_draft_model) as rt:
        from localspec.memory_store import open_memory

        recall = open_memory(rt.target, enabled=memory.enabled, lookup=memory.lookup)
        runner = ChatRunner(rt, conv, spec=spec, sampling=sampling, gen=gen,
                            session_path=session_file, reuse_prefix=not no_prompt_cache,
                            log=not no_log, tag=tag, memory=recall)
        if tty:
            from localspec.chat.app import run_app

            run_app(runner)
        else:
            from localspec.chat.repl import run_repl

            code = run_repl(runner, sys.stdin, sys.stdout, sys.stderr)
            if code:
                raise SystemExit(code)
