"""`localspec models`: the known models and the GGUF files found locally."""

from __future__ import annotations

import json

import click

from localspec.commands.ui import print_models
from localspec.models import list_models


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def models(as_json: bool) -> None:
    """List known models (manifest) and local GGUF files, with sizes."""
    rows = list_models()
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print_models(rows)
