"""Grammar-constrained decoding (GBNF, JSON schema): llama.cpp's grammar sampler on the
real SmolLM2 vocabulary, the constrained round with and without speculation, and `run
--json-schema / --grammar`. The server's response_format is in test_serve.py.

Lossless with speculation means: greedy constrained output equals plain constrained
output (up to near-ties, see test_real_models.py), a drafted token the grammar forbids
is never emitted, and sampled constrained output follows the constrained distribution.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from fakes import chi2_pvalue
from test_cli import cli
from test_engine_fake import (
    S_PROMPT,
    SCFG,
    SV,
    TARGET_P,
    ArgmaxChainDrafter,
    stochastic_draft,
    stochastic_target,
)
from test_real_models import NEAR_TIE

from localspec.core import engine as engine_mod
from localspec.core.backend import JSON_GBNF, Grammar, json_schema_grammar
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.constrain import top_allowed
from localspec.core.drafters import NgramDrafter, NoDrafter
from localspec.core.drafters.draft_model import ModelDrafter
from localspec.core.engine import collect, generate
from localspec.core.errors import GrammarError
from localspec.core.chat_template import chat_prompt

GREEDY = SamplingConfig(temperature=0.0)
PERSON = {"type": "object", "required": ["name", "age", "hobbies"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "items": {"type": "string"}}}}
COLOR = {"type": "object", "required": ["color", "bright", "hue"], "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}, "hue": {"type": "number"}}}
CITY = {"type": "object", "required": ["city", "location"], "properties": {
    "city": {"type": "string", "maxLength": 40},
    "location": {"type": "object", "required": ["lat", "lon"],
                 "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}}}}
FRUITS = {"type": "array", "minItems": 2, "maxItems": 3, "items": {
    "type": "object", "required": ["fruit", "count"],
    "properties": {"fruit": {"type": "string"}, "count": {"type": "integer"}}}}
CASES = {
    "person": (PERSON, "Describe Alice, 30, who likes chess and tennis, as JSON."),
    "color": (COLOR, "Describe the colour of the sky at noon as JSON."),
    "city": (CITY, "Give the city of Paris and its coordinates as JSON."),
    "fruits": (FRUITS, "List two fruits in my basket with how many of each I have: 3 apples, 5 pears."),
}
LOWERCASE = 'root ::= [a-z] [a-z ]* "."\n'  # one lowercase sentence: no capitals, commas, newlines


def pieces(model, ids):
    return [model.token_piece(t) for t in ids]


# ----- the grammar sampler on SmolLM2's vocabulary ------------------------------------


def test_grammar_allows_exactly_the_prefixes_and_eog_only_at_the_end(smol):
    g = Grammar(smol, 'root ::= "yes" | "no"')
    allowed = np.flatnonzero(g.allowed_all())
    texts = {smol.token_piece(int(t)) for t in allowed}
    assert texts and all(b"yes".startswith(t) or b"no".startswith(t) for t in texts), texts
    assert {b"y", b"n"} <= texts and not g.allows(smol.eos)  # EOG only once complete
    assert not g.allows(smol.tokenize("maybe", add_special=False)[0])
    twin = g.clone()
    for t in smol.tokenize("yes", add_special=False):
        g.accept(t)
    assert g.allows(smol.eos) and np.flatnonzero(g.allowed_all()).tolist() == [
        t for t in range(smol.n_vocab) if smol.is_eog(t)]  # complete: nothing but the end
    assert not twin.allows(smol.eos) and twin.allows(smol.tokenize("no", add_special=False)[0])
    row = np.random.default_rng(0).normal(size=smol.n_vocab).astype(np.float32)
    masked = g.mask(row)
    assert np.isfinite(masked).sum() == len([t for t in range(smol.n_vocab) if smol.is_eog(t)])
    assert masked[smol.eos] == row[smol.eos]
    g.reset()
    assert not g.allows(smol.eos) and g.allows(smol.tokenize("y", add_special=False)[0])
    g.close()
    twin.close()


def test_accepting_a_forbidden_token_raises_instead_of_aborting(smol):
    # llama.cpp aborts the whole process on a token its grammar forbids
    with Grammar(smol, 'root ::= "yes" | "no"') as g:
        with pytest.raises(GrammarError, match="not allowed"):
            g.accept(smol.tokenize("maybe", add_special=False)[0])
        with pytest.raises(GrammarError):
            g.accept(smol.eos)
        g.accept(smol.tokenize("no", add_special=False)[0])  # still usable
        assert g.allows(smol.eos)


@pytest.mark.parametrize("text, reason", [
    ("root ::= foo", "Undefined rule identifier 'foo'"),
    ("root ::= [a-", "unexpected end of input"),
    ('start ::= "a"', "does not contain a 'root' symbol"),
    ("  ", "empty"),
])
def test_invalid_grammar_is_one_clear_line(smol, capfd, text, reason):
    with pytest.raises(GrammarError) as e:
        Grammar(smol, text)
    msg = str(e.value)
    assert msg.startswith("invalid grammar: ") and reason in msg and "\n" not in msg
    assert capfd.readouterr().err == ""  # llama.cpp's parser printed into the message, not the terminal


@pytest.mark.parametrize("schema, fault", [
    ({"type": "foo"}, "invalid JSON schema at type"),
    ({"type": "object", "properties": 5}, "invalid JSON schema at properties"),
    ({"type": "object", "required": "name"}, "invalid JSON schema at required"),
    ([{"type": "string"}], "expected an object"),
    ({"$ref": "#/$defs/missing"}, "unsupported JSON schema"),
    ({"type": "string", "pattern": "abc"}, "unsupported JSON schema"),  # the converter wants ^...$
])
def test_invalid_json_schema_is_a_grammar_error(schema, fault):
    with pytest.raises(GrammarError, match=re.escape(fault)):
        json_schema_grammar(schema)


def test_json_schemas_convert_and_compile(smol):
    defs = {"$defs": {"pt": {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}},
            "type": "array", "items": {"$ref": "#/$defs/pt"}}
    for schema in (*[s for s, _ in CASES.values()], defs, {"type": "string", "format": "date"}, {}):
        Grammar(smol, json_schema_grammar(schema)).close()
    Grammar(smol, JSON_GBNF).close()


def test_json_strings_cannot_hold_raw_control_characters(smol):
    # llama-cpp-python's converter allowed a raw newline inside a string (invalid JSON)
    newline = smol.tokenize("\n", add_special=False)
    tab = smol.tokenize("\t", add_special=False)
    assert len(newline) == len(tab) == 1
    for gbnf in (json_schema_grammar({"type": "string"}), JSON_GBNF):
        with Grammar(smol, gbnf) as g:
            for t in smol.tokenize('{"a": "x' if gbnf is JSON_GBNF else '"x', add_special=False):
                g.accept(t)
            assert g.allows(smol.tokenize("y", add_special=False)[0])
            assert not g.allows(newline[0]) and not g.allows(tab[0])


# ----- the constrained choice (pure numpy, a stand-in grammar) ------------------------


class SetGrammar:
    """A grammar that allows a fixed set of ids, counting the whole-vocabulary asks."""

    def __init__(self, ok: np.ndarray) -> None:
        self.ok = ok
        self.full = 0

    def allows(self, t):
        return bool(self.ok[t])

    def allowed(self, ids):
        return self.ok[np.asarray(ids)]

    def allowed_all(self):
        self.full += 1
        return self.ok.copy()


@pytest.mark.parametrize("density", [0.5, 0.02, 0.0005])
def test_top_allowed_equals_masking_the_whole_row(density):
    rng = np.random.default_rng(7)
    for _ in range(20):
        logits = rng.normal(size=5000).astype(np.float32)
        ok = rng.random(5000) < density
        for n in (1, 5, 40):
            g = SetGrammar(ok)
            masked = np.where(ok, logits, -np.inf)
            want = np.argsort(-masked, kind="stable")[: min(n, ok.sum())]
            assert top_allowed(logits, g, n).tolist() == want.tolist()
            if density == 0.5 or n == 1 and density == 0.02:
                assert g.full == 0  # found among the best candidates: the vocabulary never scanned


# ----- sampled constrained speculation follows the constrained distribution ----------
# the fake target of test_engine_fake, under a grammar "a token may not repeat the one
# before it"; drafters that know the grammar (ModelDrafter: q constrained) and that do not
# (the argmax chain and an unconstrained model: both propose repeats the grammar forbids)


class NoRepeat:
    def __init__(self, n_vocab: int) -> None:
        self.n_vocab, self.last = n_vocab, -1

    def allows(self, t):
        return t != self.last

    def allowed(self, ids):
        return np.asarray(ids) != self.last

    def allowed_all(self):
        return self.allowed(np.arange(self.n_vocab))

    def accept(self, t):
        assert self.allows(t), f"accepted {t} after {self.last}: the grammar forbids it"
        self.last = t

    def clone(self):
        twin = NoRepeat(self.n_vocab)
        twin.last = self.last
        return twin

    def close(self):
        pass


class UnconstrainedModelDrafter(ModelDrafter):
    def constrain(self, grammar):
        pass  # drafts from the unconstrained q, so it proposes forbidden tokens


def no_repeat_joint() -> np.ndarray:
    def step(last):  # p(next | last) under the grammar
        p = TARGET_P[last].copy()
        p[last] = 0.0
        return p / p.sum()

    p1 = TARGET_P[S_PROMPT[-1]]  # the first token follows nothing generated: free
    return np.einsum("a,ab,bc->abc", p1, np.array([step(a) for a in range(SV)]),
                     np.array([step(b) for b in range(SV)]))


@pytest.mark.parametrize("make", [
    lambda s: NoDrafter(), lambda s: ArgmaxChainDrafter(),
    lambda s: ModelDrafter(stochastic_draft(), s), lambda s: UnconstrainedModelDrafter(stochastic_draft(), s),
], ids=["none", "argmax", "model", "model-unconstrained"])
def test_sampled_constrained_speculation_follows_the_constrained_distribution(monkeypatch, make):
    monkeypatch.setattr(engine_mod, "Grammar", lambda model, text: NoRepeat(model.n_vocab))
    counts = np.zeros((SV,) * 3, dtype=np.int64)
    target, drafted = stochastic_target(), 0
    for seed in range(1000):
        sampling = SamplingConfig(seed=seed, **SCFG)
        ids, _, stats = collect(generate(target, S_PROMPT, make(sampling), sampling=sampling,
                                         spec=SpecConfig(mode="model", draft_max=3),
                                         gen=GenerationConfig(max_tokens=4, grammar="no-repeat")))
        counts[tuple(ids[:3])] += 1
        drafted += stats.drafted
    assert drafted > 1000 or isinstance(make(None), NoDrafter)  # speculation really happened
    assert chi2_pvalue(counts, no_repeat_joint()) > 1e-4  # 0 if a repeat was ever emitted


# ----- greedy: with speculation equals without, on SmolLM2 ----------------------------


def plain_constrained(model, prompt, gbnf, n):
    """Reference: one token per decode, the whole row masked by the grammar, recording
    the top-2 margin among allowed tokens (independent of constrain.py's shortcuts)."""
    tokens, margins = [], []
    model.rewind(0)
    logits, _ = model.prefill(prompt)
    with Grammar(model, gbnf) as g:
        for _ in range(n):
            masked = g.mask(logits)
            top2 = np.partition(masked, -2)[-2:]
            margins.append(float(top2[1] - top2[0]))
            tok = int(np.argmax(masked))
            if model.is_eog(tok):
                break
            tokens.append(tok)
            g.accept(tok)
            logits = model.decode([tok], "last")[0]
    model.rewind(0)
    return tokens, margins


def assert_same(plain, margins, ids):
    for i, (a, b) in enumerate(zip(plain, ids)):
        if a != b:
            assert margins[i] < NEAR_TIE, f"diverged at token {i}, plain margin {margins[i]:.3f}"
            return
    assert ids == plain


def _run(target, prompt, drafter, gbnf, *, sampling=GREEDY, mode="model", n=96, draft_model=None):
    for m in (target, draft_model):
        if m is not None:
            m.rewind(0)  # each run prefills from an empty cache, as the reference does
    return collect(generate(target, prompt, drafter, sampling=sampling, spec=SpecConfig(mode=mode),
                            gen=GenerationConfig(max_tokens=n, grammar=gbnf), draft_model=draft_model))


@pytest.mark.parametrize("case", ["person", "city"])
def test_greedy_constrained_output_is_the_same_with_speculation(smol, smol_draft, case):
    schema, question = CASES[case]
    gbnf = json_schema_grammar(schema)
    prompt = chat_prompt(smol, question)
    plain, margins = plain_constrained(smol, prompt, gbnf, 96)
    for name, drafter in (("none", NoDrafter()), ("ngram", NgramDrafter(1, 4)),
                          ("model", ModelDrafter(smol_draft, GREEDY))):
        ids, text, stats = _run(smol, prompt, drafter, gbnf, mode=name, draft_model=smol_draft)
        assert_same(plain, margins, ids)
        assert stats.stop_reason == "eos", (name, text)
        jsonschema.validate(json.loads(text), schema)
        if name != "none":
            assert stats.drafted > 0, name
        if name == "model":  # drafting within the grammar, SmolLM2 for itself: all accepted
            assert stats.accepted >= 0.9 * stats.drafted, stats.to_dict()


# ----- a drafted token the grammar forbids is never emitted ---------------------------


class RecordingDrafter(UnconstrainedModelDrafter):
    """SmolLM2 drafting for itself without the grammar: it proposes the target's own
    unconstrained continuation, the very tokens a verify that skipped the grammar would
    accept (commas, capitals, newlines here)."""

    def begin(self, prompt):
        self.drafts = []

    def draft(self, context, k):
        d = super().draft(context, k)
        self.drafts.append(d.tokens)
        return d


def test_forbidden_drafted_tokens_are_rejected_greedy(smol, smol_draft):
    prompt = chat_prompt(smol, "Write one sentence about cats.")
    plain, margins = plain_constrained(smol, prompt, LOWERCASE, 60)
    drafter = RecordingDrafter(smol_draft, GREEDY)
    ids, text, stats = _run(smol, prompt, drafter, LOWERCASE, n=60, draft_model=smol_draft)
    forbidden = [p for d in drafter.drafts for p in pieces(smol, d) if re.search(rb"[^a-z .]", p)]
    assert forbidden, "the drafter proposed nothing the grammar forbids: the test proves nothing"
    assert re.fullmatch(r"[a-z][a-z ]*\.", text), text
    assert_same(plain, margins, ids)
    assert stats.accepted > 0  # the allowed drafts were accepted


@pytest.mark.parametrize("seed", [1, 2])
def test_forbidden_drafted_tokens_are_rejected_sampled(smol, smol_draft, seed):
    sampling = SamplingConfig(temperature=0.8, seed=seed)
    prompt = chat_prompt(smol, "Write one sentence about cats.")
    drafter = RecordingDrafter(smol_draft, sampling)
    _, text, stats = _run(smol, prompt, drafter, LOWERCASE, sampling=sampling, n=60, draft_model=smol_draft)
    forbidden = [p for d in drafter.drafts for p in pieces(smol, d) if re.search(rb"[^a-z .]", p)]
    assert forbidden and stats.drafted > 0
    assert re.fullmatch(r"[a-z][a-z ]*\.?", text), text
    assert stats.stop_reason in ("eos", "length")


# ----- run --json-schema / --grammar ---------------------------------------------------


def test_run_json_schema_output_validates(smol_path, tmp_path):
    schema_file = tmp_path / "city.json"
    schema_file.write_text(json.dumps(CITY))
    proc = cli("run", "-m", smol_path, "--json-schema", str(schema_file), "-n", "96", "--stats", "json",
               "--spec", "model", "--no-log", CASES["city"][1])
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), CITY)
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["stop_reason"] == "eos" and stats["drafted"] > 0  # drafted by SmolLM2 itself (--draft auto)


def test_run_grammar_file(smol_path, tmp_path):
    gbnf = tmp_path / "lower.gbnf"
    gbnf.write_text(LOWERCASE)
    proc = cli("run", "-m", smol_path, "--grammar", str(gbnf), "-n", "60", "-q", "--no-log",
               "Write one sentence about cats.")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"[a-z][a-z ]*\.\n", proc.stdout), proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--json-schema", "{SCHEMAS}/bad.json"], "invalid JSON schema at type"),
    (["--json-schema", "{SCHEMAS}/missing.json"], "cannot read"),
    (["--json-schema", "{SCHEMAS}/notjson.json"], "is not JSON"),
    (["--json-schema", '{"type": "object", "properties": []}'], "invalid JSON schema at properties"),
    (["--grammar", "{SCHEMAS}/bad.gbnf"], "invalid grammar: Undefined rule identifier 'foo'"),
    (["--grammar", "{SCHEMAS}/bad.gbnf", "--json-schema", "{SCHEMAS}/bad.json"], "exclude each other"),
])
def test_run_bad_structured_output_input_is_one_line_exit_2(smol_path, tmp_path, args, message):
    (tmp_path / "bad.json").write_text('{"type": "foo"}')
    (tmp_path / "notjson.json").write_text("{'type': 'object'}")
    (tmp_path / "bad.gbnf").write_text("root ::= foo\n")
    args = [a.replace("{SCHEMAS}", str(tmp_path)) for a in args]
    proc = cli("run", "-m", smol_path, "--no-log", *args, "hello")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
