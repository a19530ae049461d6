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


def print_models(rows: Sequence) -> None:
    table = Table(title="models")
    for col in ("name", "roles", "size", "present"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.name, ", ".join(r.roles) or "-", human_size(r.size),
            str(r.path) if r.path else "[dim]not pulled[/] (localspec pull " + r.name + ")",
        )
    Console().print(table)
