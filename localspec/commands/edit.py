"""`localspec edit`: rewrite files with the target model, n-gram drafted from the file."""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
from click.core import ParameterSource

from localspec.commands.options import (
    LoadOptions,
    MemoryOptions,
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
from localspec.core.errors import ContextFull, LocalspecError, UsageError
from localspec.core.events import StopReason
from localspec.edit import (
    EDIT_SPEC_DEFAULTS,
    Region,
    Source,
    build_prompt_parts,
    choose_fence,
    parse_lines,
    read_source,
    rewrite,
    source_from_bytes,
    split_lines,
    split_region,
    unified_diff,
    write_atomic,
)


@click.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@click.option("-i", "--instruction", default=None, help="what to change")
@click.option("--instruction-file", type=click.Path(dir_okay=False), default=None,
              help="read the instruction from this file")
@click.option("--lines", "lines_spec", default=None, metavar="A:B",
              help="edit only lines A..B (1-based, inclusive; A: or :B); the rest is kept byte for byte")
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False),
              help="write the result here instead of replacing FILE")
@click.option("--dry-run", is_flag=True, help="print the diff, write nothing")
@click.option("--backup", is_flag=True, help="keep the replaced file as FILE.orig")
@click.option("-y", "--yes", is_flag=True, help="write without asking (a terminal is asked)")
@click.option("-q", "--quiet", is_flag=True, help="no progress bar or stats on stderr")
@click.option("-n", "--n-predict", "--max-tokens", "max_tokens", type=int, default=None,
              help="most tokens to generate [default: 2x the original's tokens + 256; <= 0: "
                   "until the context is full]")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="keep the file's KV state on disk, so the next edit of the unchanged file "
                   "prefills only the instruction (LOCALSPEC_PREFIX_CACHE_MB caps its size, "
                   "default 1024; 0 turns it off)")
@model_options()
@spec_options
@sampling_options
@log_options
@memory_options
@click.pass_context
def edit(ctx: click.Context, files: tuple[str, ...], instruction: str | None,
         instruction_file: str | None, lines_spec: str | None, output: str | None,
         dry_run: bool, backup: bool, yes: bool, quiet: bool, max_tokens: int | None,
         prefix_cache: bool, tag: str | None, no_log: bool, **kw) -> None:
    """Rewrite FILE as the instruction says; show the diff; write it atomically.

    The model returns the whole file (or --lines range); drafting copies spans of the
    original, so unchanged text costs little. Edit's own defaults: --spec auto,
    --draft-max 256, --ngram-min 3, --ngram-max 12. Nothing is written unless the
    answer is complete.

    \b
      localspec edit app.py -i "add type hints"
      localspec edit app.py --lines 40:80 -i "use pathlib" --dry-run
      cat a.py | localspec edit - -i "rename foo to bar" > b.py
    """
    memory = memory_config(kw)
    opts, spec, sampling = resolve_options(ctx, kw)
    filter_mode = files == ("-",)
    if "-" in files and not filter_mode:
        raise click.UsageError("'-' (stdin) must be the only FILE")
    if (output or lines_spec) and len(files) > 1:
        raise click.UsageError("-o and --lines take a single FILE")
    text = _instruction(instruction, instruction_file, stdin_free=not filter_mode)
    first, last = parse_lines(lines_spec) if lines_spec else (None, None)
    jobs = [read_job(f, first, last) for f in files]  # bad input fails before the model loads
    session = Session(
        opts=opts, spec=spec, sampling=sampling, instruction=text, max_tokens=max_tokens,
        dry_run=dry_run, backup=backup, output=output, filter_mode=filter_mode,
        confirm=not yes and not dry_run and sys.stdin.isatty(), show_progress=not quiet,
        tag=tag or "edit", log=not no_log, prefix_cache=prefix_cache, memory=memory,
    )
    ctx.exit(session.run(jobs))


def resolve_options(ctx: click.Context, kw: dict) -> tuple[LoadOptions, SpecConfig, SamplingConfig]:
    """Edit's own defaults for the shared flags left at their defaults, then the configs."""
    has_draft = bool(kw.get("draft") and kw["draft"].lower() != "none")
    for name, value in EDIT_SPEC_DEFAULTS.items():  # edit's own defaults for shared flags
        if ctx.get_parameter_source(name) == ParameterSource.DEFAULT:
            kw[name] = value
    if ctx.get_parameter_source("ngram_min") == ParameterSource.DEFAULT:
        kw["ngram_min"] = min(kw["ngram_min"], kw["ngram_max"])  # a low --ngram-max wins
    opts = load_options(kw, (ctx.obj or {}).get("verbose", False))
    return opts, spec_config(kw, has_draft=has_draft), sampling_config(kw)


def configs_for(args: Sequence[str] = ()) -> tuple[LoadOptions, SpecConfig, SamplingConfig]:
    """What `localspec edit FILE -i ... ARGS` runs with (for benchmark scripts): the same
    parsing, environment variables and edit defaults as the command."""
    ctx = edit.make_context("edit", ["-", "-i", "-", *args])
    return resolve_options(ctx, dict(ctx.params))


def _instruction(text: str | None, path: str | None, stdin_free: bool) -> str:
    if text is not None and path is not None:
        raise click.UsageError("give -i or --instruction-file, not both")
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--instruction-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    elif text is None:
        if not stdin_free:
            raise UsageError("with FILE '-' (stdin), give the instruction with -i or --instruction-file")
        if sys.stdin.isatty():
            raise UsageError("no instruction: give -i TEXT, --instruction-file PATH, or pipe it on stdin")
        text = sys.stdin.read()
    if not text.strip():
        raise UsageError("the instruction is empty")
    return text


@dataclass
class Job:
    """One input: where it came from, its text and the region to rewrite."""

    path: str | None  # None: stdin
    source: Source
    region: Region
    n_lines: int


def read_job(name: str, first: int | None, last: int | None) -> Job:
    if name == "-":
        src, path = source_from_bytes(sys.stdin.buffer.read()), None
    else:
        src, path = read_source(name), name
    region = split_region(src.text, first, last)
    return Job(path, src, region, len(split_lines(src.text)))


@dataclass
class Session:
    """Options that hold for every file of one `localspec edit` call."""

    opts: LoadOptions
    spec: SpecConfig
    sampling: SamplingConfig
    instruction: str
    max_tokens: int | None
    dry_run: bool
    backup: bool
    output: str | None
    filter_mode: bool
    confirm: bool
    show_progress: bool
    tag: str = "edit"
    log: bool = True
    prefix_cache: bool = True
    memory: MemoryOptions = MemoryOptions()
    _recall: object | None = None  # the opened memory (memory_store.open_memory)

    def run(self, jobs: list[Job]) -> int:
        """Edit each job in turn; the exit status (1 when one ended without an answer,
        130 when interrupted: then the file being edited is left as it was)."""
        from localspec.runtime import open_runtime
        from localspec.prefix_store import PrefixStore

        cache = PrefixStore() if self.prefix_cache else None
        failed = 0
        ctrl_c = CtrlC()
        job = jobs[0]
        try:
            with ctrl_c.catching():
                rt = open_runtime(self.opts, want_draft=self.spec.mode.uses_draft_model)
            with rt:
                if self.spec.mode.uses_memory:
                    from localspec.memory_store import open_memory

                    self._recall = open_memory(rt.target, enabled=self.memory.enabled, lookup=self.memory.lookup,
                                               defer=True)
                prepared = [(job, *self._prepare(rt.target, job)) for job in jobs]  # all fit?
                for job, (prompt, n_prefix), file_tokens in prepared:
                    if ctrl_c.pressed:
                        raise KeyboardInterrupt
                    try:
                        failed += not self._edit_one(rt, job, prompt, n_prefix, file_tokens, ctrl_c, cache)
                    except LocalspecError as exc:
                        if len(jobs) == 1:
                            raise
                        click.echo(f"error: {exc}", err=True)
                        failed += 1
        except KeyboardInterrupt:
            click.echo(f"interrupted: {job.source.name} not changed", err=True)
            return 130
        return 1 if failed else 0

    def _prepare(self, target, job: Job) -> tuple[tuple[list[int], int], list[int]]:
        """((prompt, length of its instruction-free prefix), the text's tokens)."""
        prompt, n_prefix = build_prompt_parts(target, job.region, job.source.name, job.n_lines,
                                              self.instruction)
        file_tokens = target.tokenize(job.region.body, add_special=False, parse_special=False)
        need = len(prompt) + len(file_tokens) + 16  # the answer is about as long as the file
        if need > target.n_ctx:
            r = job.region
            what = "the file is" if (r.first, r.last) == (1, job.n_lines) else f"lines {r.first}-{r.last} are"
            raise ContextFull(
                f"{job.source.name}: {what} {len(file_tokens)} tokens; prompt and answer need about "
                f"{need} but the context is {target.n_ctx}: raise -c, or edit a part at a time "
                f"with --lines A:B"
            )
        return (prompt, n_prefix), file_tokens

    def _gen(self, target, prompt: list[int], file_tokens: list[int]) -> GenerationConfig:
        room = target.n_ctx - len(prompt)
        if self.max_tokens is None:
            return GenerationConfig(max_tokens=min(room, 2 * len(file_tokens) + 256))
        return GenerationConfig(max_tokens=min(room, self.max_tokens) if self.max_tokens > 0 else room)

    def _edit_one(self, rt, job: Job, prompt: list[int], n_prefix: int, file_tokens: list[int],
                  ctrl_c: CtrlC, cache) -> bool:
        from localspec.commands.progress import EditProgress, summary_line
        from localspec.runtime import log_run, make_drafter
        from localspec.prefix_store import restore_prefix, store_prefix, warm_prefix

        name = job.source.name
        drafter = make_drafter(self.spec, self.sampling, rt.draft, file_tokens, target=rt.target,
                               memory=self._recall, instruction=self.instruction, filename=job.path)
        live = self.show_progress and sys.stderr.isatty()
        with ctrl_c.catching(), EditProgress(Path(name).name, len(file_tokens), enabled=live) as progress:
            # the file's KV state from the prefix cache, or prefilled and stored there
            use = warm_prefix(rt.target, prompt[:n_prefix], cache, lambda: ctrl_c.pressed)
            draft_hit = restore_prefix(rt.draft, prompt[:n_prefix], cache)
            if ctrl_c.pressed:
                raise KeyboardInterrupt
            outcome = rewrite(
                rt.target, drafter, prompt, choose_fence(job.region.body),
                sampling=self.sampling, spec=self.spec, gen=self._gen(rt.target, prompt, file_tokens),
                draft_model=rt.draft, on_event=progress, should_stop=lambda: ctrl_c.pressed,
            )
        if ctrl_c.pressed:
            raise KeyboardInterrupt
        if not draft_hit:  # not after Ctrl-C: raised above
            store_prefix(rt.draft, prompt[:n_prefix], cache)
        stats = outcome.stats
        if stats is not None:
            use.add_to(stats)
            if self.show_progress:
                line = summary_line(stats, progress.plain_token_s, use.saved_s)
                click.echo(f"{name}: {line}", err=True)
            log_run("edit", stats, rt.target, rt.draft, self.spec, self.sampling, tag=self.tag,
                    prompt_text=self.instruction, output_text=outcome.reply, enabled=self.log)
        if outcome.body is None:
            why = {StopReason.LENGTH: f"stopped at the token limit, {stats.generated if stats else 0} "
                                      "tokens (raise -n, or -c)",
                   StopReason.CONTEXT: "the context filled up (raise -c)"}.get(
                stats.stop_reason if stats else "", "the model ended without closing the block")
            click.echo(f"{name}: no complete answer ({why}); nothing written", err=True)
            getattr(self._recall, "discard", lambda: None)()  # nor remembered
            return False
        getattr(self._recall, "commit", lambda: None)()
        return self._apply(job, outcome.body)

    def _apply(self, job: Job, body: str) -> bool:
        src, region = job.source, job.region
        unchanged = region.unchanged(body)
        new_text = src.text if unchanged else region.join(body)
        if self.filter_mode and not self.dry_run and self.output is None:
            sys.stdout.buffer.write(src.encode(new_text))  # a filter passes text through
            sys.stdout.flush()
            if unchanged:
                click.echo("no changes", err=True)
            return True
        if unchanged:
            click.echo(f"{src.name}: no changes", err=True)
            if self.output is not None and not self.dry_run:  # -o still gets the text
                self._write(job, self.output, src.data)
            return True
        _print_diff(unified_diff(src.text, new_text, _diff_name(src.name)))
        if self.dry_run:
            return True
        dest = self.output or job.path
        if self.confirm and not click.confirm(f"write {dest}?", default=False, err=True):
            click.echo(f"{dest}: not changed", err=True)
            return True
        self._write(job, dest, src.encode(new_text))
        click.echo(f"wrote {dest}", err=True)
        return True

    def _write(self, job: Job, dest: str, data: bytes) -> None:
        src = job.source

        def still_original() -> None:  # refuse to overwrite a change made meanwhile
            if job.path is not None and Path(dest).resolve() == Path(job.path).resolve():
                try:
                    current = Path(job.path).read_bytes()
                except OSError:
                    current = None
                if current != src.data:
                    raise UsageError(f"{job.path} changed on disk during the edit; not written")

        try:
            if self.backup and Path(dest).exists():
                still_original()
                # a link standing at FILE.orig is replaced, never written through
                write_atomic(f"{dest}.orig", Path(dest).read_bytes(), stat.S_IMODE(Path(dest).stat().st_mode),
                             follow_symlinks=False)
            mode = src.mode if (src.mode is not None and not Path(dest).exists()) else None
            write_atomic(dest, data, mode, before_replace=still_original)
        except OSError as exc:
            raise LocalspecError(f"{dest}: cannot write: {exc.strerror or exc}; nothing changed") from None


class CtrlC:
    """Ctrl-C as a flag while llama.cpp works: the generation stops after the round and
    nothing is written. (A KeyboardInterrupt that lands in llama.cpp's log callback is
    swallowed by ctypes, and the edit would go on.) A second Ctrl-C raises at once."""

    def __init__(self) -> None:
        self.pressed = False

    @contextmanager
    def catching(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _handle(self, signum: int, frame: object) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True


def _diff_name(name: str) -> str:
    """The path for diff headers: relative to the working directory when inside it, so
    `git apply` / `patch -p1` take the diff as is."""
    rel = os.path.relpath(name)
    return rel if not rel.startswith("..") else name.lstrip("/")


def _print_diff(diff: str) -> None:
    """On stdout; coloured when stdout is a terminal (click strips the colour otherwise)."""
    colours = {"+": "green", "-": "red", "@": "cyan"}
    for line in diff.rstrip("\n").split("\n") if diff else []:
        colour = None if line.startswith(("+++", "---")) else colours.get(line[:1])
        click.echo(click.style(line, fg=colour, bold=line.startswith(("+++", "---"))))
