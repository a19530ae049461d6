"""`localspec models`: the known models and the GGUF files found locally, including
those other tools downloaded (hub cache, llama.cpp, LM Studio, Ollama)."""

from __future__ import annotations

import json

import click

from localspec.commands.ui import print_drafts, print_models
from localspec.models import list_models, resolve


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--drafts-for", "drafts_for", metavar="TARGET", default=None,
              help="which local models could draft for TARGET (what --draft auto picks), and why "
                   "each other one cannot")
def models(as_json: bool, drafts_for: str | None) -> None:
    """List known models (manifest) and local GGUF files: sizes, architecture, parameters,
    quantisation, read from each file's header.

    \b
    Searched: LOCALSPEC_MODELS and localspec's cache, the Hugging Face hub cache
    (HF_HUB_CACHE/HF_HOME), llama.cpp's cache (LLAMA_CACHE), LM Studio (~/.lmstudio/models)
    and Ollama (OLLAMA_MODELS or ~/.ollama/models). The NAME column is what -m accepts.
    """
    if drafts_for is not None:
        from localspec.models.drafts import draft_candidates

        target = resolve(drafts_for, role="target")
        candidates = draft_candidates(target)
        if as_json:
            click.echo(json.dumps({"target": str(target), "candidates": [c.to_dict() for c in candidates]},
                                  indent=2))
        else:
            print_drafts(drafts_for, candidates)
        return
    rows = list_models()
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print_models(rows)
