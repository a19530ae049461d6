"""Grammars and JSON schemas that llama.cpp's grammar code or llama-cpp-python's converter
cannot survive (a segfault, a loop until memory runs out, minutes of work) are refused
before they reach it (core/backend/gbnf_check.py, schema_check.py), and the mirror of
llama.cpp's parser the bounds rest on agrees with llama.cpp.

Every call that would crash without the bounds runs in a subprocess (`localspec run`, or
a child python), so a regression fails the test instead of killing the test worker.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import cli

from localspec.core.backend import JSON_GBNF, json_schema_grammar
from localspec.core.backend.gbnf_check import check_gbnf, verdict
from localspec.core.errors import GrammarError


def nested(n: int) -> str:
    return "root ::= " + "(" * n + '"a"' + ")" * n + "\n"


def shared(n: int, tail: str = "") -> str:
    """Each rule twice in the next: 2^n paths for llama.cpp's left-recursion check."""
    rules = [f'a{i} ::= a{i + 1} {tail}| a{i + 1} {tail}' for i in range(n)]
    return "\n".join(["root ::= a0", *rules, f'a{n} ::= "x"']) + "\n"


def deep_schema(n: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "array", "items": s}
    return s


def shared_schema(n: int) -> dict:
    defs = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/a{i + 1}"}]} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    return {"$defs": defs, "type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "required": ["x"]}


# what each does to llama.cpp without the bounds
CRASHING_GRAMMARS = {
    "5000 nested groups (segfault)": (nested(5000), "nested more than 1024 deep"),
    "{5,3} (rules until memory runs out)": ('root ::= "a"{5,3}\n', "the maximum is below the minimum"),
    "left recursion through an empty rule (expands forever)":
        ('root ::= d root "x" | "z"\nd ::= e\ne ::= "" | "y"\n', "left recursion: rule 'root'"),
    "a rule shared 2^32 ways (hours of checking)": (shared(32), "can begin in more than 1024 ways"),
    "the same behind a rule llama.cpp forgets (redefined)":
        ('root ::= b\nroot ::= d root "x" | "z"\nd ::= e\ne ::= "" | "y"\n', "left recursion: rule 'root'"),
    "45,000 rules each beginning with the next (72 s)":
        ("root ::= a0\n" + "".join(f'a{i} ::= a{i + 1} "x"\n' for i in range(45_000)) + 'a45000 ::= "y"\n',
         "more than 2048 deep"),
}
ISSUE_SCHEMAS = {  # issue 27's three, and the others it names
    "maxLength 20000": ({"type": "string", "maxLength": 20000}, "maxLength is 20000"),
    "maxItems 20000": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 20000},
                       "maxItems is 20000"),
    "pattern a{0,20000}": ({"type": "string", "pattern": "^a{0,20000}$"}, "{0,20000}"),
    "minLength 10^7": ({"type": "string", "minLength": 10_000_000}, "minLength is 10000000"),
    "190 deep": (deep_schema(190), "nested more than 64 deep"),
    "5000 nested pattern groups": ({"type": "string", "pattern": "^" + "(" * 5000 + "a" + ")" * 5000 + "$"},
                                   "nested more than 64 deep"),
    "a $ref shared 2^30 ways": (shared_schema(30), "can begin in more than 1024 ways"),
    "200 optional properties": ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)}},
                                "200 optional properties"),
}


def _limited() -> None:
    """A child that would loop until memory runs out stops at 4 GiB instead."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("name", list(CRASHING_GRAMMARS))
def test_run_refuses_a_crashing_grammar_in_one_line(smol_path, tmp_path, name):
    text, why = CRASHING_GRAMMARS[name]
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", smol_path, "--grammar", str(gbnf),
                           "-n", "4", "--no-log", "hi"], capture_output=True, text=True, timeout=120,
                          preexec_fn=_limited, env=os.environ)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-500:])
    err = proc.stderr.strip()
    assert why in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("name", list(ISSUE_SCHEMAS))
def test_schema_past_a_bound_is_a_grammar_error(name):
    schema, why = ISSUE_SCHEMAS[name]
    with pytest.raises(GrammarError) as exc:
        json_schema_grammar(schema)
    assert why in str(exc.value) and "\n" not in str(exc.value)


def test_run_json_schema_past_a_bound_is_one_line(smol_path, tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(ISSUE_SCHEMAS["maxLength 20000"][0]))
    proc = cli("run", "-m", smol_path, "--json-schema", str(f), "-n", "4", "--no-log", "hi", timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = cli("run", "-m", smol_path, "--json-schema", '{"a":' * 20_000, "-n", "4", "--no-log", "hi", timeout=120)
    assert proc.returncode == 2 and "nests too deeply" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-300:]


def test_usual_grammars_and_schemas_are_within_the_bounds():
    from test_grammar import CASES

    check_gbnf(JSON_GBNF)
    for schema, _ in CASES.values():
        json_schema_grammar(schema)
    json_schema_grammar({"type": "string", "maxLength": 1000})
    json_schema_grammar({"enum": [f"value {i}" for i in range(1000)]})
    json_schema_grammar({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(128)}})
    json_schema_grammar(deep_schema(60))
    check_gbnf(nested(1024))
    check_gbnf('root ::= [a-z]{0,2000} "x"*\n')


@pytest.mark.parametrize(("text", "why"), [
    ('root ::= "a"{0,5000}\n', "at most 2000 repetitions"),
    ('root ::= "' + "a" * 600_000 + '"{2}\n', "more than 1000000 elements"),
    ("root ::= " + " | ".join(f'"v{i}"' for i in range(1100)) + "\n", "can begin in more than 1024 ways"),
    ("root ::= " + "a " * 60_000 + "\na ::= \"a\"\n", None),
    ("root ::= " + '"a" ' * 10 + "\n" + "".join(f"r{i} ::= \"x\"{{0,1000}}\n" for i in range(60)), "more than 50000 rules"),
    ('root ::= root "x" | "y"\n', "left recursion"),
    ("root ::= a0\n" + "".join(f'a{i} ::= a{i + 1} "x"\n' for i in range(2100)) + 'a2100 ::= "y"\n',
     "begins with rules more than 2048 deep"),
    ("root ::= a0\n" + "".join(f'a{i} ::= a{i + 1} "x"\n' for i in range(1000)) + 'a1000 ::= "y"\n', None),
    ("root ::= " + "x" * (1 << 20) + "\n", "bytes, at most"),
])
def test_each_grammar_bound(text, why):
    if why is None:
        check_gbnf(text)  # within the bounds (whatever llama.cpp then says of it)
        return
    with pytest.raises(GrammarError, match=why):
        check_gbnf(text)


# ----- the mirror agrees with llama.cpp ------------------------------------------------

_PIECES = ["root", "a", "b", "x-y", "root_3", '"a"', '"\\x41"', '"\\q"', '""', '"\\""', "[a-z]", '[^"]', "[]",
           "[a-]", "[\\]]", "(", ")", "|", "*", "+", "?", "{2}", "{1,3}", "{2,}", "{0}", "{ 1 , 2 }", ".", "\n",
           "\r\n", " ", "# c\n", "::=", "{", "}", ",", "<[5]>", "!<[7]>", "\t"]
_atom = st.sampled_from(['"a"', '"bc"', "[a-c]", '[^"]', ".", "a", "b", "root", '""', "<[3]>"])


def _expr(kids):
    return st.one_of(
        st.lists(kids, min_size=1, max_size=3).map(" ".join),
        st.lists(kids, min_size=2, max_size=3).map(" | ".join),
        kids.map(lambda k: f"({k})"),
        st.tuples(kids, st.sampled_from(["*", "+", "?", "{2}", "{0,3}", "{1,}", "{0}"])).map("".join),
    )


_rules = st.lists(st.tuples(st.sampled_from(["root", "a", "b"]), st.recursive(_atom, _expr, max_leaves=8)),
                  min_size=1, max_size=4).map(lambda rs: "".join(f"{n} ::= {e}\n" for n, e in rs))
_soup = st.lists(st.sampled_from(_PIECES), max_size=24).map("".join)


@st.composite
def grammars(draw) -> str:
    """A grammar of rules, maybe damaged (a piece inserted or cut), or a soup of pieces."""
    if draw(st.booleans()):
        return draw(_soup)
    text = draw(_rules)
    if draw(st.booleans()):
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(st.sampled_from(_PIECES)) + text[i + draw(st.integers(0, 2)):]
    return text


_LLAMA = """
import json, sys
from localspec.core.backend import Model
from localspec.core.backend.ggml import _ll, captured
from localspec.core.config import ModelConfig
m = Model(ModelConfig(path=sys.argv[1], n_ctx=64))
out = []
for text in json.load(sys.stdin):
    with captured():
        smpl = _ll.llama_sampler_init_grammar(m.llama_vocab, text.encode(), b"root")
    out.append(bool(smpl))
    if smpl:
        _ll.llama_sampler_free(smpl)
with open(sys.argv[2], "w") as f:  # not stdout: llama.cpp's log may share it
    json.dump(out, f)
"""


def test_mirror_agrees_with_llama_cpp(smol_path, tmp_path):
    """Whether llama.cpp accepts a grammar is what the mirror says, for generated and
    damaged grammars within the bounds (llama.cpp parses them in a child process)."""
    texts: list[str] = []

    @settings(max_examples=400, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(grammars())
    def collect(text: str) -> None:
        texts.append(text)

    collect()
    mine = {}
    for t in texts:
        try:
            mine[t] = verdict(t)
        except GrammarError:
            pass  # past a bound: llama.cpp never sees it
    asked = [t for t in mine if t]  # "" is no grammar to llama.cpp (Grammar refuses it first)
    out = tmp_path / "verdicts.json"
    proc = subprocess.run([sys.executable, "-c", _LLAMA, smol_path, str(out)], input=json.dumps(asked),
                          capture_output=True, text=True, timeout=300, preexec_fn=_limited, env=os.environ)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = dict(zip(asked, json.loads(out.read_text())))
    wrong = [(t, mine[t]) for t in asked if (mine[t] == "ok") != theirs[t]]
    assert not wrong, wrong[:5]
    print("llama.cpp accepted", sum(theirs.values()), "of", len(asked), "; past a bound:", len(texts) - len(mine))
    assert sum(theirs.values()) > 50 and sum(not v for v in theirs.values()) > 50  # both outcomes exercised
