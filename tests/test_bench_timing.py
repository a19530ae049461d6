"""`localspec bench` reports the whole story: time to first token, prefill (and what the
prefix cache restored), decode speedup and end-to-end wall speedup, separately.
Real SmolLM2, one thread, tiny runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from localspec.bench import report
from localspec.bench import workloads as wl
from localspec.bench.runner import Settings, Variant, run_workload
from localspec.cli import cli
from localspec.core.config import SpecConfig
from localspec.runtime import Runtime

WORKLOADS = Path(__file__).resolve().parent.parent / "localspec" / "workloads" / "edit"


@pytest.fixture(scope="module")
def smol1(smol_path):
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    with Model(ModelConfig(path=smol_path, n_ctx=2048, n_threads=1)) as m:
        yield m


@pytest.fixture
def edit_task(tmp_path) -> Path:
    lines = (WORKLOADS / "inventory.py").read_text().splitlines(keepends=True)[:12]  # ~160 prompt tokens
    (tmp_path / "inventory.py").write_text("".join(lines))
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"file": "inventory.py", "instruction": "Rename Item to Product."}) + "\n")
    return path


VARIANTS = [Variant("none"), Variant("ngram", 8, SpecConfig(mode="ngram", draft_max=8))]


def _run(smol, task_file: Path, prefix_cache: bool):
    task = wl.name_workloads(wl.load_jsonl(task_file))[0]
    prep = wl.prepare(task, smol, 16, edit_n=12)
    results = run_workload(Runtime(smol), task, VARIANTS,
                           Settings(edit_n=12, log=False, prefix_cache=prefix_cache))
    return prep, results


def test_cold_runs_time_the_whole_prefill(smol1, edit_task):
    prep, results = _run(smol1, edit_task, prefix_cache=False)
    for r in results:
        [run] = r.runs
        assert run.restored == 0 and run.prefill_tokens == len(prep.tokens)
        assert run.prefill_s > 0 and run.ttft_s == run.prefill_s
        assert run.wall_s == pytest.approx(run.prefill_s + run.decode_s)
    none, ngram = results
    assert none.wall_speedup == pytest.approx(1.0) and ngram.wall_speedup is not None
    d = ngram.to_dict()
    assert d["restored_tokens"] == 0 and d["prefill_tokens"] == len(prep.tokens)
    assert d["ttft_s"] > 0 and d["wall_s"] > d["decode_s"] and d["wall_speedup"] > 0


def test_with_the_prefix_cache_every_variant_restores_the_file(smol1, edit_task):
    prep, results = _run(smol1, edit_task, prefix_cache=True)
    assert 100 < prep.n_prefix < len(prep.tokens)
    for r in results:
        [run] = r.runs
        assert run.restored == prep.n_prefix  # none and ngram alike: a fair comparison
        assert run.prefill_tokens == len(prep.tokens) - prep.n_prefix < 40
        assert run.cache_s > 0 and run.ttft_s == pytest.approx(run.prefill_s + run.cache_s)
    assert results[1].verdict.status in ("identical", "near-tie")
    rows = report.by_tag(results)
    assert all(d["ttft_s"] > 0 and d["wall_speedup"] for d in rows)


def test_table_shows_wall_ttft_and_cached_tokens(smol1, edit_task):
    _, results = _run(smol1, edit_task, prefix_cache=True)
    console = Console(width=250, record=True)
    console.print(report.workload_table(results, "t"))
    console.print(report.tag_table(report.by_tag(results)))
    text = console.export_text()
    assert "wall" in text and "ttft" in text and "prefill" in text
    n = results[0].runs[0].restored
    assert f"+{n} cached" in text


def test_bench_cli_prefix_cache_flag(edit_task, smol_path):
    result = CliRunner().invoke(cli, [
        "bench", "--prompts", str(edit_task), "-m", smol_path, "--modes", "none,ngram",
        "--k", "8", "--edit-n", "8", "-t", "1", "--no-log", "--json", "--prefix-cache"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert all(r["restored_tokens"] > 100 and r["prefill_tokens"] < 40 for r in data["results"])
    assert all("wall_speedup" in d and "ttft_s" in d for d in data["by_tag"])
