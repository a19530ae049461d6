"""Click options shared by the commands, and their conversion to config dataclasses.

Flags follow llama.cpp's spelling; the newer `--spec-draft-n-*` names are aliases.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import click

from localspec.core.config import (
    SPEC_MODES,
    GenerationConfig,
    LoadOptions,
    SamplingConfig,
    SpecConfig,
)
from localspec.core.errors import UsageError


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
                     shell_complete=complete_models),
        click.option("-c", "--ctx-size", "n_ctx", type=click.IntRange(min=64), default=4096,
                     show_default=True, help="context size in tokens"),
        click.option("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads [default: all cores available]"),
        click.option("-ngl", "--n-gpu-layers", "--gpu-layers", "n_gpu_layers", type=int, default=-1,
                     help="target layers on the GPU (-1: all when the build can offload)"),
        click.option("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft", "n_gpu_layers_draft",
                     type=int, default=-1, help="draft model layers on the GPU (-1: all)"),
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


def spec_options(f: Callable) -> Callable:
    return _stack(
        click.option("--spec", type=click.Choice(SPEC_MODES), default="auto", show_default=True,
                     envvar="LOCALSPEC_SPEC",
                     help="drafting: auto (picks drafter and k each round from measured costs and "
                          "acceptance), none, ngram (prompt lookup), model, hybrid (n-gram, else "
                          "the model)"),
        click.option("--draft-max", "--spec-draft-n-max", "draft_max", type=click.IntRange(0, 256),
                     default=None, help="most tokens drafted per round [default: 32 for auto, else 16]"),
        click.option("--draft-min", "--spec-draft-n-min", "draft_min", type=click.IntRange(0, 256),
                     default=0, show_default=True, help="drafts shorter than this are not verified"),
        click.option("--draft-p-min", "--spec-draft-p-min", "draft_p_min",
                     type=click.FloatRange(0, 1), default=0.75, show_default=True,
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


def load_options(kw: dict, verbose: bool = False) -> LoadOptions:
    return LoadOptions(
        model=kw.pop("model"), draft=kw.pop("draft"), n_ctx=kw.pop("n_ctx"),
        n_threads=kw.pop("n_threads"), n_gpu_layers=kw.pop("n_gpu_layers"),
        n_gpu_layers_draft=kw.pop("n_gpu_layers_draft"), verbose=verbose,
        rpc=kw.pop("rpc"), tensor_split=kw.pop("tensor_split"), flash_attn=kw.pop("flash_attn"),
    )


def spec_config(kw: dict, has_draft: bool) -> SpecConfig:
    mode = kw.pop("spec") or "auto"
    if mode in ("model", "hybrid") and not has_draft:
        raise click.UsageError(f"--spec {mode} needs a draft model (--draft)")
    ngram_min, ngram_max = kw.pop("ngram_min"), kw.pop("ngram_max")
    if ngram_min > ngram_max:
        raise click.UsageError("--ngram-min must not exceed --ngram-max")
    draft_max = kw.pop("draft_max")
    fixed_k = kw.pop("fixed_k")
    return SpecConfig(
        mode=mode, draft_max=draft_max if draft_max is not None else (32 if mode == "auto" else 16),
        draft_min=kw.pop("draft_min"), draft_p_min=kw.pop("draft_p_min"),
        ngram_min=ngram_min, ngram_max=ngram_max,
        adaptive=not fixed_k and mode != "auto",  # auto chooses k itself
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
    converted here, before any model loads; a grammar is parsed by llama.cpp when the
    generation starts (it needs the vocabulary)."""
    grammar_file, schema_arg = kw.pop("grammar_file"), kw.pop("json_schema_file")
    if grammar_file and schema_arg:
        raise UsageError("--grammar and --json-schema exclude each other: give one")
    if grammar_file:
        return _read(grammar_file, "--grammar")
    if not schema_arg:
        return None
    inline = schema_arg.lstrip().startswith("{")
    text = schema_arg if inline else _read(schema_arg, "--json-schema")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        where = "the inline schema" if inline else schema_arg
        raise UsageError(f"--json-schema: {where} is not JSON: {exc}") from None
    # imported here: it loads llama_cpp, which only a schema needs
    from localspec.core.backend import json_schema_grammar

    return json_schema_grammar(schema)


def _read(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{option}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
