"""Click options shared by the commands, and their conversion to config dataclasses.

Flags follow llama.cpp's spelling; the newer `--spec-draft-n-*` names are aliases.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from localspec.core.config import (
    SPEC_MODES,
    GenerationConfig,
    LoadOptions,
    SamplingConfig,
    SpecConfig,
    SpecMode,
)
from localspec.core.errors import UsageError
from localspec.core.tuning import AUTO_DRAFT_MAX, DRAFT_MAX, DRAFT_P_MIN


def _stack(*decorators: Callable) -> Callable:
    def apply(f: Callable) -> Callable:
        for d in reversed(decorators):
            f = d(f)
        return f

    return apply


def complete_models(ctx: click.Context, param: click.Parameter, incomplete: str) -> list:
    """Tab completion of -m/--draft: the NAME column of `localspec models` (downloaded
    ones first), plus auto and none for --draft. Never fails: completion stays quiet."""
    from click.shell_completion import CompletionItem

    try:
        from localspec.models import list_models

        rows = sorted(list_models(header=False), key=lambda r: r.path is None)
    except Exception:  # a broken store must not print a traceback into the shell
        rows = []
    items, seen = [], set()
    if param.name == "draft":
        items += [CompletionItem("auto", help="the best compatible smaller model on disk"),
                  CompletionItem("none", help="no draft model")]
    for row in rows:
        if row.name not in seen:
            seen.add(row.name)
            items.append(CompletionItem(row.name, help=row.description or row.source))
    return [item for item in items if item.value.startswith(incomplete)]


def _draft_model(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # llama.cpp's `--draft N` was the draft length: a number here would be read as a name
    # fragment and could load some *-f16.gguf
    if value is not None and value.strip().isdigit():
        raise click.BadParameter(
            f"{value} is a number, and --draft takes a draft model here (path or name); "
            f"for the most tokens drafted per round (llama.cpp's --draft N) use --draft-max {value}")
    return value


def _ctx_size(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if 0 < value < 64:
        raise click.BadParameter(f"{value}: at least 64 tokens, or 0 for the model's own context")
    return value


class GpuLayers(click.ParamType):
    """-ngl: a number of layers, or llama.cpp's `all` / `auto` (both -1 here: every layer
    when the build can offload; localspec does not fit layers to free memory)."""

    name = "N|all|auto"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower()
        if text in ("all", "auto"):
            return -1
        try:
            return int(text)
        except ValueError:
            self.fail(f"{value!r} is not a number of layers, 'all' or 'auto'", param, ctx)


def model_options(default_draft: bool = False, auto_draft: bool = False) -> Callable:
    """-m, --draft and how to load them. `auto_draft`: --draft defaults to auto (run,
    chat); `default_draft`: the command uses the manifest's default draft (bench)."""
    draft_help = ("draft model: path, manifest name, org/repo[:file.gguf], ollama:NAME:TAG, a name "
                  "fragment, 'auto' (the best compatible smaller model on disk) or 'none'")
    if default_draft:
        draft_help += " [default: the manifest's default draft]"
    return _stack(
        click.option("-m", "--model", envvar="LOCALSPEC_MODEL", default=None,
                     help="target model: path, manifest name, org/repo[:file.gguf], ollama:NAME:TAG, "
                          "lmstudio:PUBLISHER/REPO/FILE, or a part of a name `localspec models` lists "
                          "[default: qwen2.5-coder-1.5b]", shell_complete=complete_models),
        click.option("--draft", "-md", "--model-draft", "draft", envvar="LOCALSPEC_DRAFT",
                     default="auto" if auto_draft else None, show_default=auto_draft, help=draft_help,
                     shell_complete=complete_models, callback=_draft_model),
        click.option("-c", "--ctx-size", "n_ctx", type=click.IntRange(min=0), default=4096,
                     show_default=True, callback=_ctx_size,
                     help="context size in tokens; 0: the model's own (trained) context"),
        click.option("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads [default: all cores available]"),
        click.option("-ngl", "--n-gpu-layers", "--gpu-layers", "n_gpu_layers", type=GpuLayers(),
                     default=-1, help="target layers on the GPU (-1, all or auto: all when the "
                                      "build can offload)"),
        click.option("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft", "n_gpu_layers_draft",
                     type=GpuLayers(), default=-1, help="draft model layers on the GPU (-1, all or auto: all)"),
        click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(["on", "off", "auto"]),
                     default="auto", show_default=True,
                     help="flash attention for the target; auto: what `localspec tune` measured "
                          "faster on this machine (on a CPU it can cost a third of a long context's "
                          "verify), else llama.cpp's choice"),
        *rpc_options(),
    )


# ----- several machines: ggml RPC workers (llama.cpp's --rpc and --tensor-split) -----


def _parse_rpc(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    from localspec.core.rpc import parse_endpoints

    try:
        return parse_endpoints(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _parse_split(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[float, ...]:
    if not value:
        return ()
    try:  # llama.cpp splits on ',' and '/'
        shares = tuple(float(x) for x in re.split(r"[,/]+", value.strip(",/")))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a list of numbers (e.g. 3,1)") from None
    if any(not math.isfinite(x) or x < 0 for x in shares) or not any(shares):
        raise click.BadParameter("shares are numbers >= 0, at least one of them > 0")
    return shares


def rpc_options() -> tuple[Callable, ...]:
    return (
        click.option("--rpc", "rpc", metavar="HOST:PORT[,...]", envvar="LOCALSPEC_RPC", default=None,
                     callback=_parse_rpc,
                     help="ggml RPC workers (`localspec worker` on other machines): their devices "
                          "take the target's offloaded layers (-ngl), and the draft's with -ngld > 0"),
        click.option("-ts", "--tensor-split", "tensor_split", metavar="N0,N1,...", default=None,
                     callback=_parse_split,
                     help="share of the offloaded layers per device: the --rpc workers in order, "
                          "then local GPUs (e.g. 3,1) [default: by free memory]"),
    )


# llama.cpp's --spec-type names -> ours, where they are the same drafter
SPEC_TYPES = {"none": "none", "ngram-simple": "ngram", "ngram-map-k": "ngram",
              "draft": "model", "draft-simple": "model"}
# llama.cpp's other kinds, which localspec does not have
SPEC_TYPES_MISSING = ("ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-eagle3", "eagle3",
                      "draft-mtp", "draft-mtp-adaptive", "draft-dflash", "draft-dspark")


def spec_mode_of_types(value: str) -> str:
    """llama.cpp's --spec-type list (comma-separated) -> our --spec mode: n-gram lookup and
    a draft model together are `hybrid`. UsageError for a kind localspec lacks."""
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    if not names:
        raise UsageError("--spec-type: give one or more of " + ", ".join(SPEC_TYPES))
    for name in names:
        if name in SPEC_TYPES_MISSING:
            raise UsageError(
                f"--spec-type {name}: localspec has no such drafter; it has ngram-simple "
                "(= --spec ngram), draft-simple (= --spec model, with -md), both (--spec hybrid), "
                "and --spec auto, which picks between them each round")
        if name not in SPEC_TYPES:
            raise UsageError(f"--spec-type {name}: unknown; llama.cpp's names are "
                             + ", ".join([*SPEC_TYPES, *SPEC_TYPES_MISSING]))
    kinds = {SPEC_TYPES[n] for n in names} - {"none"}
    if not kinds:
        return "none"
    return "hybrid" if len(kinds) > 1 else kinds.pop()


def _spec_type(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None:
        return
    try:
        mode = spec_mode_of_types(value)
    except UsageError as exc:
        raise click.BadParameter(str(exc).removeprefix("--spec-type ")) from None
    ctx.meta["localspec.spec_type"] = (value, mode)
    if "spec" in ctx.params:  # --spec came first on the command line: reconcile now
        ctx.params["spec"] = _reconcile_spec(ctx, ctx.params["spec"])


def _spec_mode(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return _reconcile_spec(ctx, value)


def _reconcile_spec(ctx: click.Context, spec: str | None) -> str | None:
    """--spec and --spec-type name the same thing: a --spec-type wins over --spec's default
    or environment value, and an explicit --spec that says otherwise is an error."""
    given = ctx.meta.get("localspec.spec_type")
    if given is None:
        return spec
    value, mode = given
    explicit = ctx.get_parameter_source("spec") == click.core.ParameterSource.COMMANDLINE
    if explicit and spec != mode:
        raise click.UsageError(f"--spec {spec} and --spec-type {value} (= --spec {mode}) disagree: give one")
    # given on the command line, as far as commands with their own --spec default know
    ctx.set_parameter_source("spec", click.core.ParameterSource.COMMANDLINE)
    return mode


def spec_options(f: Callable) -> Callable:
    return _stack(
        click.option("--spec", type=click.Choice(SPEC_MODES), default="auto", show_default=True,
                     envvar="LOCALSPEC_SPEC", callback=_spec_mode,
                     help="drafting: auto (picks drafter and k each round from measured costs and "
                          "acceptance), none, ngram (prompt lookup), model, hybrid (n-gram, else "
                          "the model)"),
        click.option("--spec-type", metavar="TYPE[,TYPE]", default=None, expose_value=False,
                     callback=_spec_type,
                     help="llama.cpp's names for --spec: ngram-simple or ngram-map-k (= ngram), "
                          "draft-simple (= model), both (= hybrid), none"),
        click.option("--draft-max", "--draft-n", "--spec-draft-n-max", "draft_max", type=click.IntRange(0, 256),
                     default=None,
                     help=f"most tokens drafted per round [default: {AUTO_DRAFT_MAX} for auto, else {DRAFT_MAX}]"),
        click.option("--draft-min", "--spec-draft-n-min", "draft_min", type=click.IntRange(0, 256),
                     default=0, show_default=True, help="drafts shorter than this are not verified"),
        click.option("--draft-p-min", "--spec-draft-p-min", "draft_p_min",
                     type=click.FloatRange(0, 1), default=DRAFT_P_MIN, show_default=True,
                     help="the model drafter stops when its top probability falls below this"),
        click.option("--ngram-min", type=click.IntRange(1, 16), default=1, show_default=True,
                     help="shortest context suffix the n-gram drafter matches"),
        click.option("--ngram-max", type=click.IntRange(1, 16), default=4, show_default=True,
                     help="longest context suffix the n-gram drafter matches"),
        click.option("--fixed-k", is_flag=True, help="always draft --draft-max (no adaptive k)"),
    )(f)


def sampling_options(f: Callable) -> Callable:
    return _stack(
        click.option("--temp", "--temperature", "temperature", type=click.FloatRange(min=0),
                     default=0.0, show_default=True, help="0 is greedy"),
        click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True),
        click.option("--top-p", type=click.FloatRange(0, 1), default=0.95, show_default=True),
        click.option("--min-p", type=click.FloatRange(0, 1), default=0.05, show_default=True),
        click.option("--seed", type=int, default=None, help="random seed for sampling"),
    )(f)


def gen_options(default_max: int = 512) -> Callable:
    return _stack(
        click.option("-n", "--n-predict", "--max-tokens", "max_tokens", type=int,
                     default=default_max, show_default=True,
                     help="most tokens to generate (<= 0: until end of text or context full)"),
        click.option("--stop", multiple=True, help="stop when this text is generated (repeatable)"),
    )


def log_options(f: Callable) -> Callable:
    return _stack(
        click.option("--tag", default=None,
                     help="workload tag for the acceptance log [default: classified: code, json, edit, prose]"),
        click.option("--no-log", is_flag=True, envvar="LOCALSPEC_NO_LOG",
                     help="do not record this generation in the acceptance log"),
    )(f)


def memory_options(f: Callable) -> Callable:
    return _stack(
        click.option("--no-memory", is_flag=True, envvar="LOCALSPEC_NO_MEMORY",
                     help="neither draft from earlier outputs (kept in the state dir) nor remember this one"),
        click.option("--lookup", "lookup", multiple=True, metavar="PATH", type=click.Path(exists=True),
                     help="draft from these files too (a directory: its text files; repeatable), as "
                          "llama.cpp's static lookup cache"),
    )(f)


@dataclass(frozen=True)
class MemoryOptions:
    """--no-memory and --lookup: where `auto` drafts from besides the context."""

    enabled: bool = True
    lookup: tuple[str, ...] = ()


def memory_config(kw: dict) -> MemoryOptions:
    return MemoryOptions(enabled=not kw.pop("no_memory", False), lookup=tuple(kw.pop("lookup", ()) or ()))


def load_options(kw: dict, verbose: bool = False) -> LoadOptions:
    return LoadOptions(
        model=kw.pop("model"), draft=kw.pop("draft"), n_ctx=kw.pop("n_ctx"),
        n_threads=kw.pop("n_threads"), n_gpu_layers=kw.pop("n_gpu_layers"),
        n_gpu_layers_draft=kw.pop("n_gpu_layers_draft"), verbose=verbose,
        rpc=kw.pop("rpc"), tensor_split=kw.pop("tensor_split"), flash_attn=kw.pop("flash_attn"),
    )


def spec_config(kw: dict, has_draft: bool) -> SpecConfig:
    mode = SpecMode(kw.pop("spec") or SpecMode.AUTO)
    if mode.needs_draft_model and not has_draft:
        raise click.UsageError(f"--spec {mode} needs a draft model (--draft)")
    ngram_min, ngram_max = kw.pop("ngram_min"), kw.pop("ngram_max")
    if ngram_min > ngram_max:
        raise click.UsageError("--ngram-min must not exceed --ngram-max")
    draft_max = kw.pop("draft_max")
    fixed_k = kw.pop("fixed_k")
    return SpecConfig(
        mode=mode,
        draft_max=draft_max if draft_max is not None else (AUTO_DRAFT_MAX if mode.chooses_k else DRAFT_MAX),
        draft_min=kw.pop("draft_min"), draft_p_min=kw.pop("draft_p_min"),
        ngram_min=ngram_min, ngram_max=ngram_max, adaptive=not fixed_k,
    )


def sampling_config(kw: dict) -> SamplingConfig:
    return SamplingConfig(
        temperature=kw.pop("temperature"), top_k=kw.pop("top_k"), top_p=kw.pop("top_p"),
        min_p=kw.pop("min_p"), seed=kw.pop("seed"),
    )


def gen_config(kw: dict) -> GenerationConfig:
    return GenerationConfig(max_tokens=kw.pop("max_tokens"), stop=tuple(kw.pop("stop")))


def grammar_options(f: Callable) -> Callable:
    """--grammar FILE / --json-schema FILE: constrained output (llama.cpp's spellings of
    the file forms are aliases)."""
    return _stack(
        click.option("--grammar", "--grammar-file", "grammar_file", default=None, metavar="FILE",
                     help="GBNF grammar file (llama.cpp's format, root rule `root`): every "
                          "generated token follows it"),
        click.option("--json-schema", "-jf", "--json-schema-file", "json_schema_file", default=None,
                     metavar="FILE", help="JSON Schema file (or the schema itself, inline, when "
                                          "the value starts with '{'): the output is JSON valid under it"),
    )(f)


def grammar_text(kw: dict) -> str | None:
    """The GBNF of --grammar / --json-schema (None: neither). A schema is checked and
    converted here, before any model loads; a grammar is checked against the bounds
    here (core/backend/gbnf_check.py) and parsed by llama.cpp when the generation starts
    (it needs the vocabulary)."""
    grammar_file, schema_arg = kw.pop("grammar_file"), kw.pop("json_schema_file")
    if grammar_file and schema_arg:
        raise UsageError("--grammar and --json-schema exclude each other: give one")
    if grammar_file:
        from localspec.core.backend.gbnf_check import check_gbnf

        text = _read(grammar_file, "--grammar")
        check_gbnf(text)
        return text
    if not schema_arg:
        return None
    inline = schema_arg.lstrip().startswith("{")
    text = schema_arg if inline else _read(schema_arg, "--json-schema")
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        where = "the inline schema" if inline else schema_arg
        why = "it nests too deeply" if isinstance(exc, RecursionError) else exc
        raise UsageError(f"--json-schema: {where} is not JSON: {why}") from None
    # imported here: it loads llama_cpp, which only a schema needs
    from localspec.core.backend import json_schema_grammar

    return json_schema_grammar(schema)


def _read(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{option}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
