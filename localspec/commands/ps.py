"""`localspec ps`: the running `localspec serve` processes (Ollama's `ps`), from the
records they keep in the state dir, each with what its /health says now."""

from __future__ import annotations

import json

import click

from localspec import servers


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds to wait for each server's /health")
def ps(as_json: bool, timeout: float) -> None:
    """Running `localspec serve` servers: address, pid, model, slots in use, queue,
    speed (decode tok/s of all slots together, mean time to first token), uptime.

    \b
    Servers started with another LOCALSPEC_HOME (or XDG_STATE_HOME) are not listed.
    """
    rows = [(r, servers.health(r, timeout)) for r in servers.running()]
    if as_json:
        click.echo(json.dumps([_row_dict(r, h) for r, h in rows], indent=2))
        return
    if not rows:
        click.echo(f"No localspec servers running (records: {servers.records_dir()}).")
        return
    _print_table(rows)


def _row_dict(record: servers.ServerRecord, health: dict | None) -> dict:
    return {"url": record.url, "pid": record.pid, "model": record.model, "model_path": record.model_path,
            "draft": record.draft, "slots": record.slots, "n_ctx_seq": record.n_ctx_seq,
            "uptime_s": round(servers.uptime(record), 1), "health": health}


def _print_table(rows: list[tuple[servers.ServerRecord, dict | None]]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("url", "pid", "model", "status", "slots", "queued", "spec", "tok/s", "ttft", "requests",
                 "up"):
        table.add_column(name, justify="right" if name in ("pid", "tok/s", "ttft", "requests", "up") else "left",
                         no_wrap=name != "model", overflow="fold")
    for record, h in rows:
        model = record.model + (f" + {record.draft}" if record.draft else "")
        if h is None:
            table.add_row(record.url, str(record.pid), model, "not answering", f"-/{record.slots}",
                          "-", "-", "-", "-", "-", _age(servers.uptime(record)))
            continue
        speed = h.get("speed") or {}
        tps, ttft = speed.get("decode_tokens_per_s"), speed.get("ttft_s")
        spec = h.get("spec_mode", "-") + ("" if h.get("speculation", True) else " (off)")
        table.add_row(
            record.url, str(record.pid), model, str(h.get("status", "?")),
            f"{h.get('active', '?')}/{h.get('slots', record.slots)}", str(h.get("queued", "-")), spec,
            "-" if tps is None else f"{tps:.1f}", "-" if ttft is None else f"{ttft:.2f}s",
            str(speed.get("requests", "-")), _age(servers.uptime(record)),
        )
    Console().print(table)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
