"""Terminal rendering shared by commands (rich tables on stderr/stdout)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def human_params(n: int | None) -> str:
    """135M, 1.78B: parameters as model cards write them."""
    if not n:
        return "-"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def print_models(rows: Sequence) -> None:
    """`localspec models`: ModelStatus rows, header facts where the file was read."""
    table = Table(title="models")
    for col in ("name", "source", "size", "arch", "params", "quant", "ctx"):
        table.add_column(col, no_wrap=col != "name", overflow="fold")
    table.add_column("path", overflow="fold", ratio=1)
    for r in rows:
        info = r.info
        table.add_row(
            r.name, r.source + (f" ({r.parts} parts)" if r.parts > 1 else ""), human_size(r.size),
            info.architecture if info else "-", human_params(info.n_params if info else None),
            info.quant if info and info.quant else "-",
            f"{info.context_length:,}" if info and info.context_length else "-",
            str(r.path) if r.path else "[dim]not pulled[/] (localspec pull " + r.name + ")",
        )
    Console().print(table)


def print_drafts(target: str, candidates: Sequence) -> None:
    """`localspec models --drafts-for`: each local model, kept (best first) or refused."""
    table = Table(title=f"draft candidates for {target}")
    for col in ("", "name", "source", "size", "params", "quant"):
        table.add_column(col, no_wrap=col != "name", overflow="fold")
    table.add_column("why", overflow="fold", ratio=1)
    rank = 0
    for c in candidates:
        rank += c.kept
        mark = ("[green]pick[/]" if rank == 1 else f"{rank}") if c.kept else "[dim]no[/]"
        info = c.info
        table.add_row(mark, c.name, c.source, human_size(c.size), human_params(info.n_params if info else None),
                      info.quant if info and info.quant else "-", c.reason)  # fmt: skip
    Console().print(table)
    if not any(c.kept for c in candidates):
        Console().print("no compatible smaller model on disk: --draft auto drafts with n-grams")
