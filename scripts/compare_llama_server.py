#!/usr/bin/env python3
"""Side by side on the edit workloads: llama.cpp's own n-gram speculation (llama-server)
against `localspec edit`, on the SAME prompt tokens, greedy. A benchmark, not a test.

For each edit task (localspec/workloads/edit/tasks.jsonl and scripts/heldout/tasks.jsonl)
the prompt is built exactly as `localspec edit` builds it. llama-server gets those token
ids (`/completion` accepts a token list) once per setting: plain, and each --spec-type at
each draft length; its `timings` give predicted_per_second, draft_n and
draft_n_accepted. localspec decodes the same tokens plain and with edit's default
setting (or --edit-args). The table shows each tool's decode speedup over its OWN plain
run, and localspec's speedup over the best llama-server setting (the bar: >= 1.2x), and
localspec's tok/s over the fastest llama-server run's. Decode speed excludes the prefill
on both sides. Every setting's server is up at once and each workload runs all variants
of both tools back to back (--repeat N: N such passes, medians shown), so a drift in
the machine's speed (a noisy neighbour, heat) does not land on one tool.

Draft length: in this llama.cpp, `--spec-draft-n-max` caps only model drafts; an n-gram
draft is the m-gram after the match, `--spec-ngram-simple-size-m` / `--spec-ngram-map-k-
size-m` (default 48). A setting "n 16" passes both flags with 16. The lookup n-gram keeps
llama-server's default (size-n 12, min-hits 1); --server-args adds flags to every run.

Where llama-server comes from (the first that exists): --llama-server PATH, $LLAMA_SERVER,
the build --build makes, `llama-server` on PATH. Build it from the llama.cpp that
llama-cpp-python vendors, so both sides run the same kernels (about 10 minutes on 2 cores):

    python scripts/compare_llama_server.py --build     # does the steps below
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d DIR
    tar xzf DIR/llama_cpp_python-0.3.36.tar.gz -C DIR
    cmake -S DIR/llama_cpp_python-0.3.36/vendor/llama.cpp -B BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release
    ninja -C BUILD llama-server                            # BUILD/bin/llama-server

    python scripts/compare_llama_server.py [--model NAME] [--only N] [-n TOKENS]
        [--draft-n 16,64] [--types ngram-simple,ngram-map-k] [--edit-args "--spec auto"]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from localspec.bench import workloads as wl
from localspec.bench.workers import free_port
from localspec.commands.edit import configs_for
from localspec.core import backend
from localspec.core.config import GenerationConfig
from localspec.runtime import make_drafter, open_runtime
from localspec.edit import rewrite
from localspec.models import paths
from localspec.prefix_store import PrefixStore, warm_prefix

ROOT = Path(__file__).resolve().parent.parent
TASK_FILES = {"edit": (ROOT / "localspec" / "workloads" / "edit" / "tasks.jsonl", wl.WORKLOADS_DIR),
              "heldout": (ROOT / "scripts" / "heldout" / "tasks.jsonl", None),
              "corpus": (ROOT / "scripts" / "edit_corpus" / "tasks.jsonl", None)}
BAR = 1.2


# ----- finding or building llama-server ---------------------------------------------------


def build_dir() -> Path:
    return paths.cache_dir() / f"llama.cpp-{backend.llama_cpp_version()}"


def find_server(given: str | None) -> Path:
    """The llama-server to run; exits with the build steps when there is none."""
    candidates = [given, os.environ.get("LLAMA_SERVER"),
                  *glob.glob(str(build_dir() / "*" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server")),
                  shutil.which("llama-server")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    if given:
        sys.exit(f"--llama-server {given}: not an executable file")
    sys.exit("no llama-server found: pass --llama-server PATH, set LLAMA_SERVER, or run with "
             "--build (see this script's docstring for the steps)")


def build_server() -> Path:
    """Download llama-cpp-python's sdist (the version installed) and build its vendored
    llama.cpp's llama-server, under the cache dir."""
    ver = backend.llama_cpp_version()
    top = paths.ensure(build_dir())
    src = top / f"llama_cpp_python-{ver}" / "vendor" / "llama.cpp"
    steps = []
    if not src.is_dir():
        steps += [[sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"llama-cpp-python=={ver}", "-d", str(top)],
                  ["tar", "xzf", str(top / f"llama_cpp_python-{ver}.tar.gz"), "-C", str(top)]]
    steps += [["cmake", "-S", str(src), "-B", str(src / "build"), "-G", "Ninja",
               "-DCMAKE_BUILD_TYPE=Release"],
              ["ninja", "-C", str(src / "build"), "llama-server"]]
    for cmd in steps:
        print("$", shlex.join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
    return src / "build" / "bin" / "llama-server"


def server_commit(server: Path) -> str:
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60, check=False)
    line = next((ln for ln in (out.stdout + out.stderr).splitlines() if "commit" in ln), "")
    return line.rsplit("commit", 1)[-1].strip(" )") if line else "unknown"


# ----- one llama-server per setting ---------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    kind: str  # "plain" or a --spec-type
    n: int = 0  # draft length (m-gram size)

    @property
    def label(self) -> str:
        return "plain" if self.kind == "plain" else f"{self.kind} n{self.n}"

    def flags(self) -> list[str]:
        if self.kind == "plain":
            return []
        size_m = {"ngram-simple": "--spec-ngram-simple-size-m", "ngram-map-k": "--spec-ngram-map-k-size-m",
                  "ngram-map-k4v": "--spec-ngram-map-k4v-size-m"}
        extra = [size_m[self.kind], str(self.n)] if self.kind in size_m else []
        return ["--spec-type", self.kind, "--spec-draft-n-max", str(self.n), *extra]


@dataclass
class Gen:
    """One generation's decode figures."""

    tokens: int
    tok_s: float
    drafted: int = 0
    accepted: int = 0
    text: str = ""


class Server:
    """llama-server on a free local port, for the duration of a `with` block."""

    def __init__(self, exe: Path, model: Path, setting: Setting, args: argparse.Namespace,
                 ngl: int, log_dir: Path) -> None:
        self.port = free_port()
        self.log = log_dir / f"llama-server-{setting.label.replace(' ', '-')}.log"
        self.cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    "-c", str(args.ctx), "-np", "1", "-t", str(args.threads), "-tb", str(args.threads),
                    "-b", "512", "-ub", "512", "-ngl", str(ngl), "--no-webui",
                    *setting.flags(), *shlex.split(args.server_args)]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server did not come up in 600 s; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def complete(self, tokens: list[int], n_predict: int, fence: str) -> Gen:
        body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                "stop": [f"\n{fence}\n"], "cache_prompt": True, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=7200) as r:
            out = json.loads(r.read())
        t = out["timings"]
        return Gen(t["predicted_n"], t["predicted_per_second"], t.get("draft_n", 0),
                   t.get("draft_n_accepted", 0), out.get("content", ""))


# ----- localspec on the same tokens ---------------------------------------------------------


def run_localspec(rt, prep: wl.Prepared, spec, sampling, draft, cache: PrefixStore,
                  task: wl.Workload | None = None) -> Gen:
    """One `localspec edit` generation: the prefix restored (both runs start from the
    same KV values), then rewrite() to the closing fence; decode figures only."""
    rt.target.rewind(0)
    warm_prefix(rt.target, prep.tokens[: prep.n_prefix], cache)
    drafter = make_drafter(spec, sampling, draft, prep.extra, target=rt.target,
                           instruction=task.instruction if task else "", filename=task.file if task else None)
    out = rewrite(rt.target, drafter, prep.tokens, prep.fence or "```", sampling=sampling, spec=spec,
                  gen=GenerationConfig(max_tokens=prep.max_tokens), draft_model=draft)
    s = out.stats
    return Gen(s.generated, s.tokens_per_s, s.drafted, s.accepted, out.reply)


# ----- the comparison -----------------------------------------------------------------------


@dataclass
class Row:
    name: str
    prompt_tokens: int
    runs: dict[tuple[str, str], list[Gen]] = field(default_factory=dict)  # (side, label) -> runs

    def add(self, side: str, label: str, g: Gen) -> None:
        self.runs.setdefault((side, label), []).append(g)

    def _medians(self, side: str) -> dict[str, Gen]:
        """Each variant's median-speed run on one side."""
        return {label: sorted(got, key=lambda x: x.tok_s)[len(got) // 2]
                for (s, label), got in self.runs.items() if s == side}

    @property
    def server(self) -> dict[str, Gen]:
        return self._medians("server")

    @property
    def local(self) -> dict[str, Gen]:
        return self._medians("local")

    def up(self, side: dict[str, Gen], label: str) -> float | None:
        base, g = side.get("plain"), side.get(label)
        return g.tok_s / base.tok_s if base and g and base.tok_s else None

    @property
    def best_server(self) -> tuple[str, float] | None:
        ups = [(k, self.up(self.server, k)) for k in self.server if k != "plain"]
        ups = [(k, u) for k, u in ups if u]
        return max(ups, key=lambda x: x[1]) if ups else None

    @property
    def ratio(self) -> float | None:
        best, mine = self.best_server, self.up(self.local, "default")
        return mine / best[1] if best and mine else None

    @property
    def gain(self) -> float | None:
        """localspec's default tok/s over the same without the renames and settings drafted ahead."""
        a, b = self.local.get("default"), self.local.get("unpredicted")
        return a.tok_s / b.tok_s if a and b and b.tok_s else None

    @property
    def absolute(self) -> float | None:
        """localspec's default tok/s over the fastest llama-server run's (plain included)."""
        mine, fastest = self.local.get("default"), max((g.tok_s for g in self.server.values()), default=0)
        return mine.tok_s / fastest if mine and fastest else None


def load_tasks(which: list[str], only: int) -> list[wl.Workload]:
    out = []
    for key in which:
        # a built-in set, or a workload JSONL of one's own (files relative to it)
        path, base = TASK_FILES[key] if key in TASK_FILES else (Path(key), None)
        if not path.is_file():
            sys.exit(f"--tasks: no such task set or file: {key}")
        items = wl.load_jsonl(path, base=base)
        tag = key if key in TASK_FILES else path.stem
        out += [wl.Workload(f"{tag}-{i}", w.tag, w.prompt, w.file, w.text, w.instruction)
                for i, w in enumerate(items, 1)]
    return out[:only] if only > 0 else out


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def fmt(x: float | None, suffix: str = "x") -> str:
    return "-" if x is None else f"{x:.2f}{suffix}"


def table(rows: list[Row], settings: list[Setting]) -> Table:
    t = Table(title="decode speedup over each tool's own plain run (same prompt tokens, greedy)",
              title_justify="left")
    spec_labels = [s.label for s in settings if s.kind != "plain"]
    unpredicted = any("unpredicted" in r.local for r in rows)
    for col in ["workload", "prompt", "server plain tok/s", *spec_labels, "localspec plain tok/s",
                "localspec default", *(["not foretold", "default / that"] if unpredicted else []),
                f"vs best server (bar {BAR}x)", "tok/s vs fastest server", "plain texts"]:
        t.add_column(col, justify="left" if col in ("workload", "plain texts") else "right")
    for r in rows:
        best = r.best_server
        sp, lp = r.server.get("plain"), r.local.get("plain")
        same = "-" if not (sp and lp) else _same(sp.text, lp.text)
        cells = [fmt(r.up(r.server, lab)) + _acc(r.server.get(lab)) for lab in spec_labels]
        ahead = ([fmt(r.up(r.local, "unpredicted")) + _acc(r.local.get("unpredicted")), fmt(r.gain)]
                 if unpredicted else [])
        t.add_row(r.name, str(r.prompt_tokens), fmt(sp.tok_s if sp else None, ""), *cells,
                  fmt(lp.tok_s if lp else None, ""),
                  fmt(r.up(r.local, "default")) + _acc(r.local.get("default")), *ahead,
                  fmt(r.ratio) + (f" ({best[0]})" if best else ""), fmt(r.absolute), same)
    t.add_section()
    t.add_row("geomean", "", "", *[fmt(geomean([r.up(r.server, lab) for r in rows])) for lab in spec_labels],
              "", fmt(geomean([r.up(r.local, "default") for r in rows])),
              *([fmt(geomean([r.up(r.local, "unpredicted") for r in rows])), fmt(geomean([r.gain for r in rows]))]
                if unpredicted else []),
              fmt(geomean([r.ratio for r in rows])), fmt(geomean([r.absolute for r in rows])), "")
    return t


def _same(a: str, b: str) -> str:
    """Whether the two plain runs wrote the same text (they can part at a near-tie:
    the two tools batch the prompt differently), and where they part."""
    a, b = a.rstrip(), b.rstrip()
    if a == b:
        return "same"
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"differ @{i} of {max(len(a), len(b))} chars"


def _acc(g: Gen | None) -> str:
    return f" ({g.accepted / g.drafted:.0%})" if g and g.drafted else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("--build", action="store_true", help="build llama-server first (see the docstring)")
    ap.add_argument("--model", "-m", default=None, help="target [default: the manifest's default]")
    ap.add_argument("--tasks", default="edit,heldout", help="comma-separated: edit (built-in), heldout (scripts/heldout), "
                    "or paths of workload JSONL files")
    ap.add_argument("--only", type=int, default=0, help="the first N workloads only")
    ap.add_argument("-n", "--n-predict", type=int, default=0,
                    help="token limit per generation [default: enough for the file]")
    ap.add_argument("--types", default="ngram-simple,ngram-map-k")
    ap.add_argument("--draft-n", default="16,64")
    ap.add_argument("-t", "--threads", type=int, default=backend.default_threads())
    ap.add_argument("-c", "--ctx", type=int, default=8192)
    ap.add_argument("--server-args", default="", help="extra llama-server flags for every run")
    ap.add_argument("--edit-args", default="", help="flags for localspec's side, as for `localspec edit`")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every variant this many times; the table shows each one's median run")
    ap.add_argument("--json", default=None, metavar="FILE", help="also save the numbers here")
    ap.add_argument("--unpredicted", action="store_true", help="also run localspec's default without "
                    "the instruction's foretold changes (renames.py, settings.py, sites.py), "
                    "right after it: the prediction's gain, side by side")
    args = ap.parse_args()

    exe = build_server() if args.build else find_server(args.llama_server)
    settings = [Setting("plain")] + [Setting(k, int(n)) for k in args.types.split(",")
                                     for n in args.draft_n.split(",")]
    flags = ["-m", args.model] if args.model else []
    opts, spec, sampling = configs_for([*flags, "-c", str(args.ctx), "-t", str(args.threads),
                                        *shlex.split(args.edit_args)])
    _, plain_spec, _ = configs_for([*flags, "-c", str(args.ctx), "-t", str(args.threads),
                                             "--spec", "none"])
    console = Console(stderr=True)
    with open_runtime(opts, want_draft=spec.mode in ("model", "hybrid", "auto")) as rt:
        tasks = load_tasks(args.tasks.split(","), args.only)
        preps = [wl.prepare(w, rt.target, args.n_predict, args.n_predict) for w in tasks]
        rows = [Row(w.name, len(p.tokens)) for w, p in zip(tasks, preps)]
        console.print(f"llama-server {exe} (commit {server_commit(exe)}), localspec's llama.cpp "
                      f"{backend.ggml_build()['commit']}; target {rt.target.name}, {args.threads} threads; "
                      f"localspec default: {spec}")
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            servers = start_servers(stack, exe, rt, settings, args, Path(tmp), console)
            cache = PrefixStore(Path(tmp), cap=1 << 40, min_tokens=1)
            local = {"plain": plain_spec, "default": spec, **({"unpredicted": spec} if args.unpredicted else {})}
            # plain runs side by side, then the speculative ones: a drift in the machine's
            # speed (a noisy neighbour, heat) lands on both tools
            order = [("server", "plain"), ("local", "plain"),
                     *[("server", lab) for lab in servers if lab != "plain"], ("local", "default"),
                     *([("local", "unpredicted")] if args.unpredicted else [])]
            order = [(side, lab) for side, lab in order if side == "local" or lab in servers]
            for _ in range(args.repeat):
                for w, p, row in zip(tasks, preps, rows):
                    for side, label in order:
                        if side == "server":
                            g = servers[label].complete(p.tokens, p.max_tokens, p.fence or "```")
                        else:
                            sp = local[label]
                            draft = rt.draft if sp.mode in ("model", "hybrid", "auto") else None
                            g = run_localspec(rt, p, sp, sampling, draft, cache,
                                              None if label == "unpredicted" else w)
                        row.add(side, label, g)
                        console.print(f"  {'llama-server' if side == 'server' else 'localspec':12} "
                                      f"{label:17} {row.name}: {g.tok_s:.2f} tok/s")
    Console(width=220).print(table(rows, settings))
    if args.json:
        Path(args.json).write_text(json.dumps([{"workload": r.name, "prompt_tokens": r.prompt_tokens,
            "server": {k: g.__dict__ for k, g in r.server.items()},
            "localspec": {k: g.__dict__ for k, g in r.local.items()}, "ratio": r.ratio,
            "absolute": r.absolute} for r in rows],
            indent=2) + "\n")


def start_servers(stack: contextlib.ExitStack, exe: Path, rt, settings: list[Setting], args,
                  log_dir: Path, console) -> dict[str, Server]:
    """One llama-server per setting, all up at once (idle ones take no CPU), so each
    workload runs every variant of both tools back to back."""
    servers = {}
    for s in settings:
        try:
            servers[s.label] = stack.enter_context(
                Server(exe, rt.target.path, s, args, rt.target.info.n_gpu_layers, log_dir))
        except RuntimeError as exc:
            log = Path(str(exc).rsplit("see ", 1)[-1])
            tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
            console.print(f"[red]{s.label}: {exc}[/red]\n{tail}")
    return servers


if __name__ == "__main__":
    main()
