"""The sites of an edit's type hints and docstrings (core/drafters/sites.py): read from
the instruction, found in a Python file, and where a draft copying the file stops."""

from __future__ import annotations

import pytest

from localspec.core.drafters.ngram import NgramDrafter
from localspec.core.drafters.renames import predict
from localspec.core.drafters.sites import at_tokens, sites

SOURCE = '''"""A module."""


def area(width, height=1):
    return width * height


def scale(x: float, factor) -> float:
    """Scaled."""
    return x * factor


class Box:
    def __init__(self, size):
        self.size = size

    @classmethod
    def unit(cls, *args, **kwargs):
        return cls(1)
'''


def marked(text: str, offsets: list[int]) -> str:
    """`text` with a ^ at each offset (what the assertions read)."""
    out, pos = [], 0
    for off in offsets:
        out += [text[pos:off], "^"]
        pos = off
    return "".join(out) + text[pos:]


def test_type_hints_go_after_each_bare_parameter_and_each_missing_return():
    got = marked(SOURCE, sites(SOURCE, "Add type hints to every function.", "shapes.py"))
    assert "def area(width^, height^=1)^:" in got
    assert "def scale(x: float, factor^) -> float:" in got  # annotated parts have none
    assert "def __init__(self, size^)^:" in got  # self gets none
    assert "def unit(cls, *args^, **kwargs^)^:" in got
    assert got.count("^") == 9


def test_only_the_functions_the_instruction_names_or_a_named_class_methods():
    got = marked(SOURCE, sites(SOURCE, "Add type hints to the signatures of area and scale.", "shapes.py"))
    assert got.count("^") == 4 and "def area(width^, height^=1)^:" in got
    got = marked(SOURCE, sites(SOURCE, "Annotate the methods of Box", "shapes.py"))
    assert got.count("^") == 5 and "def area(width, height=1):" in got


def test_a_docstring_goes_before_the_first_statement_of_a_body_without_one():
    got = marked(SOURCE, sites(SOURCE, "Add a short docstring to every function that lacks one.", "shapes.py"))
    assert "def area(width, height=1):\n    ^return width" in got  # the indent kept
    assert '"""Scaled."""\n    return' in got  # has one: no site
    assert "def __init__(self, size):\n        ^self.size" in got
    assert got.count("^") == 3


@pytest.mark.parametrize("instruction, filename, text", [
    ("Rename area to surface.", "shapes.py", SOURCE),  # neither hints nor docstrings
    ("Add a one-line comment above every field.", "c.py", "class C:\n    path: str\n    n: int = 1\n"),  # not foretold
    ("Add type hints to every function.", "shapes.js", SOURCE),  # not Python
    ("Add type hints to every function.", "broken.py", "def f(:\n"),  # does not parse
])
def test_no_sites(instruction, filename, text):
    assert sites(text, instruction, filename) == []


def test_offsets_map_to_the_token_that_holds_them():
    text = "def f(a):\n"
    pieces = [b"def", b" f", b"(a", b"):\n"]
    assert at_tokens(pieces, text, [7, 8]) == [3]  # after `a`, after `)`: both in `):\n`
    assert at_tokens(pieces, text, [5]) == [2]
    assert at_tokens([b"def", b" g"], text, [7]) == []  # pieces that do not spell the text


def test_predict_carries_the_sites_without_changing_the_text():
    instruction = "Add type hints to the signatures of area and scale."
    got = predict(SOURCE, instruction, "shapes.py")
    assert got is not None and got.text == SOURCE and len(got.sites) == 4
    renamed = predict(SOURCE, "Rename area to surface and add type hints to surface.", "shapes.py")
    assert "def surface(width^, height^=1)^:" in marked(renamed.text, list(renamed.sites))
    assert predict(SOURCE, "Add type hints to every function.", "shapes.js") is None


def test_a_draft_copying_the_file_stops_before_a_site():
    """Tokens as characters: the draft at the start of the file's copy runs to the site
    and no further; without the site it runs on past it (where the output inserts)."""
    text = "def area(width, height):\n    return width * height\n"
    tokens = [ord(c) for c in text]
    site = text.index(", height")
    prompt = [1, 2, 3, *tokens, 4, 5, 6]
    out = tokens[:8]  # "def area"
    stopped = NgramDrafter(3, 8, tokens, prediction=tokens, unsure=[site])
    stopped.begin(prompt)
    got = stopped.draft([*prompt, *out], 40).tokens
    assert "".join(map(chr, got)) == "(width"
    plain = NgramDrafter(3, 8, tokens)
    plain.begin(prompt)
    assert len(plain.draft([*prompt, *out], 40).tokens) == 40
    # where the output kept the file at the site, the copy goes on after it
    kept = [*prompt, *tokens[: site + 1]]
    assert "".join(map(chr, stopped.draft(kept, 10).tokens)) == " height):\n"


def test_the_runtime_stops_drafts_at_a_signature_it_will_annotate(smol):
    """make_drafter (what `localspec edit` calls) on SmolLM2's tokenizer: a draft at the
    start of `def area` stops inside the signature; the plain edit drafter runs past it."""
    from localspec.core.config import SamplingConfig, SpecConfig
    from localspec.runtime import make_drafter

    spec = SpecConfig(mode="ngram", ngram_min=3, ngram_max=12)
    tok = lambda s: smol.tokenize(s, add_special=False, parse_special=False)  # noqa: E731
    file_tokens = tok(SOURCE)
    prompt = [*tok("Rewrite this file:\n```python\n"), *file_tokens, *tok("\n```\n```python\n")]
    head = next(file_tokens[:n] for n in range(len(file_tokens))
                if smol.detokenize(file_tokens[:n]).endswith("def"))
    instruction = "Add type hints to area."
    ahead = make_drafter(spec, SamplingConfig(), None, file_tokens, target=smol,
                         instruction=instruction, filename="shapes.py")
    ahead.begin(prompt)
    drafted = smol.detokenize(ahead.draft([*prompt, *head], 32).tokens)
    assert drafted and "area(width".startswith(drafted.strip()[:10]) and "height" not in drafted
    plain = make_drafter(spec, SamplingConfig(), None, file_tokens, target=smol)
    plain.begin(prompt)
    assert "return width" in smol.detokenize(plain.draft([*prompt, *head], 32).tokens)


def test_a_change_learned_at_one_site_is_a_guess_at_the_next():
    """Tokens as characters. The output typed f's signature; where it begins to type g's,
    the change learned at f (`: int) -> int`) is drafted, and the draft ends there: g's
    hints are the instruction's unknown text. Without the sites the draft copies on."""
    text = "def f(a):\n    pass\n\n\ndef g(a):\n    return a\n"
    after = "def f(a: int) -> int:\n    pass\n\n\ndef g(a: str) -> str:\n    return a\n"
    tokens, out = [ord(c) for c in text], [ord(c) for c in after]
    where = sites(text, "Add type hints to f and g.", "m.py")
    assert len(where) == 4
    prompt = [1, 2, 3, *tokens, 4, 5, 6]
    drafts = []
    for unsure in (where, ()):
        drafter = NgramDrafter(3, 8, tokens, prediction=tokens, unsure=unsure)
        drafter.begin(prompt)
        for i in range(after.index("g(a:") + 5):  # the output so far ends "def g(a:"
            got = drafter.draft([*prompt, *out[:i]], 40).tokens
        drafts.append("".join(map(chr, got)))
    assert drafts[0].startswith(" int) -> int") and "return" not in drafts[0]
    assert drafts[1].startswith(" int) -> int") and "return a" in drafts[1]
