"""`localspec bench`: workloads, the runner's output check, V(n), report and CLI.

Real-model parts use SmolLM2-135M (drafting for itself in `model` mode), tiny runs."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner
from test_real_models import plain_greedy

from localspec.bench import workloads as wl
from localspec.bench.runner import (
    NEAR_TIE,
    Settings,
    Variant,
    compare,
    run_peer,
    run_workload,
)
from localspec.bench.vcurve import expected_tokens, measure_vcurve
from localspec.cli import cli
from localspec.core.config import SpecConfig
from localspec.core.chat_template import chat_prompt
from localspec.runtime import Runtime

PROMPT = {"prompt": "List the days of the week, one per line.", "tag": "prose"}
# One thread: with more threads than idle cores, llama.cpp's spinning thread barrier
# makes tiny models several times slower (CI runners and shared machines are busy).
THREADS = "1"


@pytest.fixture(scope="module")
def smol1(smol_path):
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    with Model(ModelConfig(path=smol_path, n_ctx=2048, n_threads=1)) as m:
        yield m


@pytest.fixture(scope="module")
def smol1_draft(smol_path):
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    with Model(ModelConfig(path=smol_path, n_ctx=2048, n_threads=1)) as m:
        yield m


def invoke(*args: str):
    return CliRunner().invoke(cli, ["bench", *args], env={"COLUMNS": "200"})


@pytest.fixture
def one_prompt(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(PROMPT) + "\n")
    return str(path)


def tiny(one_prompt: str, smol_path: str, *extra: str):
    return invoke("--prompts", one_prompt, "-m", smol_path, "--draft", smol_path,
                  "--modes", "none,ngram,model", "-n", "16", "-t", THREADS, *extra)


# ----- pure parts ---------------------------------------------------------------------


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 8) == 1.0  # nothing accepted: the target's own token
    assert expected_tokens(1.0, 8) == 9.0  # everything: k drafts + the bonus token
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_tokens(0.7, 0) == 1.0


def test_builtin_workloads_cover_every_tag():
    items = wl.builtin()
    assert {w.tag for w in items} == {"code", "json", "prose", "edit"}
    edits = [w for w in items if w.is_edit]
    assert len(edits) == 3 and all(w.text and w.instruction for w in edits)
    assert len({w.name for w in items}) == len(items)
    picked = wl.select(items, per_tag=1)
    assert [w.tag for w in picked] == ["code", "json", "prose", "edit"]
    assert [w.tag for w in wl.select(items, ["edit"])] == ["edit"] * 3


def test_user_workloads_default_tags(tmp_path):
    (tmp_path / "a.py").write_text("def f(x):\n    return x\n")
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps(o) for o in [
        {"prompt": "Output only JSON: an array of three colours."},
        {"file": "a.py", "instruction": "Rename f to g."},
        {"prompt": "Tell me about rivers.", "tag": "Mine"},
    ]) + "\n\n")
    items = wl.name_workloads(wl.load_jsonl(path))
    assert [w.tag for w in items] == ["prose", "edit", "mine"]
    assert items[1].text.startswith("def f") and items[1].name == "edit-1"


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read"),
    ("", "no workloads"),
    ("{not json}\n", ":1: not JSON"),
    ('["a list"]\n', ":1: expected a JSON object"),
    ('{"prompt": "ok"}\n{"tag": "code"}\n', ":2: needs a non-empty \"prompt\""),
    ('{"file": "missing.py", "instruction": "x"}\n', ":1:"),
    ('{"file": "x.py"}\n', "instruction"),
])
def test_bad_prompts_file_is_one_line_exit_2(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    result = invoke("--prompts", str(path))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.output


@pytest.mark.parametrize("args, needle", [
    (["--modes", "none,turbo"], "unknown mode turbo"),
    (["--k", "4,x"], "comma-separated integers"),
    (["--k", "0"], "between 1 and 256"),
    (["--tags", "poetry"], "no workload tagged poetry"),
    (["--draft", "none", "--modes", "none,model"], "needs a draft model"),
])
def test_bad_options_exit_2(args, needle):
    result = invoke(*args)
    assert result.exit_code == 2 and needle in result.stderr, result.output


def test_plot_without_matplotlib_fails_before_loading(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = invoke("--plot", "out.png", "-m", "/nonexistent.gguf")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "pip install matplotlib" in lines[0]


# ----- real model: SmolLM2 ------------------------------------------------------------


def test_tiny_bench_table(one_prompt, smol_path):
    result = tiny(one_prompt, smol_path, "--no-log")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "speedup" in out and "per tag" in out and "prose" in out
    rows = [line for line in out.splitlines() if " ngram " in line or " model " in line]
    assert len(rows) >= 2 and all("identical" in r or "near-tie" in r for r in rows[:2])
    assert "MISMATCH" not in out


def test_tiny_bench_json_and_log(one_prompt, smol_path):
    from localspec.acceptance.logdb import read_records

    result = tiny(one_prompt, smol_path, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["target"]["name"].startswith("SmolLM2") and data["draft"]
    res = {r["mode"]: r for r in data["results"]}
    assert list(res) == ["none", "ngram", "model"]
    for r in res.values():
        for key in ("workload", "tag", "k", "tokens", "tokens_per_s", "speedup", "acceptance",
                    "tokens_per_draft_round", "expected_tokens_per_round", "k_mean", "c", "output",
                    "cpu_s", "cpu_speedup"):
            assert key in r
        assert r["tokens"] == 16 and r["tag"] == "prose" and r["tokens_per_s"] > 0
    assert res["none"]["speedup"] == 1.0 and res["none"]["output"]["status"] == "baseline"
    model = res["model"]
    # SmolLM2 drafting for itself: (nearly) everything is accepted
    assert model["acceptance"] > 0.8 and model["output"]["status"] in ("identical", "near-tie")
    assert model["expected_tokens_per_round"] >= 1.0 and model["c"] > 0
    assert res["ngram"]["output"]["status"] in ("identical", "near-tie")
    assert {d["mode"] for d in data["by_tag"]} == {"none", "ngram", "model"}
    logged = read_records()
    assert len(logged) == 3 and {r.command for r in logged} == {"bench"}
    assert {r.tag for r in logged} == {"prose"}


def test_vcurve_returns_n_entries_normalised(smol1, smol1_draft):
    vc = measure_vcurve(smol1, 6, repeats=1, context=32, draft=smol1_draft)
    assert len(vc.ms) == 6 and len(vc.v) == 6 and vc.v[0] == 1.0
    assert all(m > 0 for m in vc.ms) and vc.c is not None and vc.c > 0
    d = vc.to_dict()
    assert d["n"] == [1, 2, 3, 4, 5, 6] and d["v"][0] == 1.0
    assert vc.at(1) == 1.0 and vc.at(100) == vc.v[-1]


def test_compare_reports_divergence_with_margin(smol1):
    smol = smol1
    prompt = chat_prompt(smol, "Greet me.")
    plain = run_workload(Runtime(smol), wl.Workload("p-1", "prose", prompt="Greet me."),
                         [Variant("none")], Settings(n_predict=8, log=False))[0].runs[0].ids
    assert compare(smol, prompt, plain, plain).status == "identical"
    # the plain run's top-2 margins, from the reference's own one-token decodes
    ref, margins = plain_greedy(smol, prompt, len(plain))
    assert ref == plain
    clear = [i for i, m in enumerate(margins) if abs(m - NEAR_TIE) > 0.05]
    expected = {i: "near-tie" if margins[i] < NEAR_TIE else "MISMATCH" for i in clear}
    assert 0 in expected and set(expected.values()) == {"near-tie", "MISMATCH"}, margins
    for i, status in expected.items():  # a wrong token at i: index, margin and verdict
        wrong = [*plain[:i], (plain[i] + 1) % smol.n_vocab, *plain[i + 1:]]
        v = compare(smol, prompt, plain, wrong)
        assert (v.index, v.status) == (i, status) and abs(v.margin - margins[i]) < 0.05, (v, margins)
    shorter = compare(smol, prompt, plain, plain[:5])
    assert shorter.index == 5 and abs(shorter.margin - margins[5]) < 0.05


def test_edit_task_runs_to_the_closing_fence(smol1, tmp_path):
    smol = smol1
    (tmp_path / "conf.json").write_text('{\n  "debug": true,\n  "port": 8080\n}\n')
    (tmp_path / "t.jsonl").write_text(json.dumps({"file": "conf.json", "instruction": "Set debug to false."}))
    task = wl.name_workloads(wl.load_jsonl(tmp_path / "t.jsonl"))[0]
    prep = wl.prepare(task, smol, 64)
    assert task.tag == "edit" and prep.fence == "```" and prep.extra
    assert prep.max_tokens == len(prep.extra) * 3 // 2 + 64  # auto: enough for the file
    ngram = Variant("ngram", 8, SpecConfig(mode="ngram", draft_max=8))
    res = run_workload(Runtime(smol), task, [Variant("none"), ngram],
                       Settings(n_predict=64, edit_n=40, log=False))
    assert [r.variant.mode for r in res] == ["none", "ngram"]
    assert res[1].verdict.status in ("identical", "near-tie")
    assert res[1].speedup is not None and res[1].acceptance is not None
    for r in res:  # the model closes its block well within 40 tokens: cut there
        text = smol.detokenize(r.runs[0].ids)
        assert r.runs[0].stop_reason == "fence" and r.tokens < 40, (r.variant.label, text)
        assert text.endswith("\n```\n") and text.count("```") == 1, text
    # and generation stopped there: plain decoding spent one round per token after the first
    assert res[0].runs[0].rounds == res[0].tokens - 1


def test_peer_llama_cpp_python_matches_plain(smol1, smol_path):
    smol = smol1
    from localspec.bench.peer import open_peer

    task = wl.Workload("c-1", "code", prompt="Write a Python function that adds two numbers.")
    prep = wl.prepare(task, smol, 24)
    # the AMX workaround as the backend applies it (a batch on AMX segfaults without it)
    peer = open_peer("llama-cpp-python", smol_path, n_ctx=512, n_threads=1, num_pred_tokens=8)
    try:
        res = run_workload(Runtime(smol), task, [Variant("none"), Variant("peer", 8)],
                           Settings(n_predict=24, log=False), peer=peer)
        again = run_peer(peer, smol, prep, Variant("peer", 4), _Count())
    finally:
        peer.close()
    plain, p = res
    assert not p.error, p.error
    assert p.tokens == plain.tokens and p.verdict.status in ("identical", "near-tie")
    assert p.runs[0].rounds >= 1 and p.tokens_per_s > 0 and p.speedup
    assert len(again.ids) == 24


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def step(self, label: str, budget: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        self.n += n


def test_plot_writes_a_png(one_prompt, smol_path, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    result = invoke("--prompts", one_prompt, "-m", smol_path, "--draft", "none", "-n", "8",
                    "-t", THREADS, "--no-log", "--vcurve", "--vcurve-max", "4", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "verify cost V(n)" in result.stdout


def test_serve_flag_runs_the_serve_bench_after_the_bench(monkeypatch, one_prompt, smol_path):
    from localspec.bench import serve_bench

    calls = []

    def fake(**kw):
        calls.append(kw)
        return {"runs": [], "fake": True}

    monkeypatch.setattr(serve_bench, "run_serve_bench", fake)
    result = invoke("--prompts", one_prompt, "-m", smol_path, "--draft", "none", "-n", "4",
                    "-t", THREADS, "--no-log", "--json", "--serve", "--concurrency", "1,2")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["serve"] == {"runs": [], "fake": True} and len(data["results"]) == 2
    assert calls[0]["concurrency"] == [1, 2] and calls[0]["n_predict"] == 4
