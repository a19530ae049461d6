"""An edit's renames drafted ahead (core/drafters/renames.py): the instruction read, the
file renamed where the old names are code, and the n-gram drafter copying that
prediction in place of the file. Pure, but for the last tests (SmolLM2's tokenizer)."""

from __future__ import annotations

import pytest

from localspec.core.drafters import NgramDrafter
from localspec.core.drafters.renames import Predicted, parse, predict, replacements


@pytest.mark.parametrize("instruction, pairs", [
    ("Rename the class Item to Product everywhere in this file.", [("Item", "Product")]),
    ("rename foo to bar", [("foo", "bar")]),
    ("Rename the parameters lo and hi to low and high everywhere, docstrings included.",
     [("lo", "low"), ("hi", "high")]),
    ("Rename `get_user` -> `fetch_user` and update the callers", [("get_user", "fetch_user")]),
    ("rename a_b, c_d and e_f to x, y and z.", [("a_b", "x"), ("c_d", "y"), ("e_f", "z")]),
    ("Rename the class Foo to Bar. Then rename baz to qux.", [("Foo", "Bar"), ("baz", "qux")]),
    ("rename foo to bar, and fix the tests", [("foo", "bar")]),
    ("Renaming old_name to new_name; nothing else", [("old_name", "new_name")]),
])
def test_an_instruction_that_renames_is_read(instruction, pairs):
    assert parse(instruction) == pairs


@pytest.mark.parametrize("instruction", [
    "Add type hints to every function.",
    "Rename the variables to something clearer.",  # no names given
    "rename foo and bar to baz",  # lists of different lengths
    "Rename Foo.bar to Foo.baz",  # a dotted name: not a whole word of the file
    "Set LOG_LEVEL to debug in every service.",
])
def test_an_instruction_that_renames_nothing_certain_is_not_read(instruction):
    assert parse(instruction) == []


@pytest.mark.parametrize("instruction, pairs", [
    ("Replace `print(` with `log.info(` everywhere.", [("print(", "log.info(")]),
    ('change all occurrences of "localhost" to "0.0.0.0"', [("localhost", "0.0.0.0")]),
    ("Replace 'a' with 'b' and rename c to d.", [("a", "b")]),
    ('Replace "localhost" with "0.0.0.0" in the tests.', []),  # narrowed: wrong everywhere else
    ("Replace the loop with a comprehension.", []),  # nothing quoted: no text given
])
def test_an_instruction_that_replaces_quoted_text_is_read(instruction, pairs):
    assert replacements(instruction) == pairs


def test_a_replacement_is_made_wherever_its_text_occurs_before_the_renames():
    text = 'url = "http://localhost:80"  # localhost only\nhost = old_host("localhost")\n'
    r = predict(text, 'Replace "localhost" with "0.0.0.0" and rename old_host to new_host.', "net.py")
    assert r is not None and r.old == ("old_host",)
    assert r.text == text.replace("localhost", "0.0.0.0").replace("old_host", "new_host")
    assert predict(text, 'Replace "nowhere" with "x".', "net.py") is None
    # a word is replaced as a whole word, not inside other words
    assert predict("a = data[a]\n", "Replace `a` with `b`.", "x.py").text == "b = data[b]\n"


SOURCE = '''"""Items: an Item is a thing in stock."""

__all__ = ["Item", "Stock"]


class Item:
    # an Item has a name
    name: str


def first(items: list[Item]) -> Item:
    print("no Item here")  # an Item, in a comment
    return Item(items[0].name)
'''


def test_code_is_renamed_and_prose_is_left_to_the_model():
    """Names and a string holding the name alone (`__all__`) are code; a docstring, a
    comment and a sentence in a string are prose, left as written."""
    r = predict(SOURCE, "Rename the class Item to Product.", "stock.py")
    assert r is not None and r.old == ("Item",)
    assert r.text == SOURCE.replace('["Item"', '["Product"').replace("class Item", "class Product") \
        .replace("list[Item]) -> Item", "list[Product]) -> Product").replace("return Item(", "return Product(")
    assert '"""Items: an Item is a thing in stock."""' in r.text  # docstring kept
    assert "# an Item has a name" in r.text and '"no Item here"' in r.text


def test_a_file_no_lexer_knows_is_renamed_throughout_and_a_name_absent_gives_nothing():
    r = predict("Item and Items; Item.\n", "rename Item to Product", "notes.unknownext")
    assert r is not None and r.text == "Product and Items; Product.\n"
    assert predict(SOURCE, "rename Widget to Gadget", "stock.py") is None
    assert predict(SOURCE, "add type hints", "stock.py") is None


def test_a_lexer_that_fails_gives_no_prediction_not_an_error(monkeypatch):
    from pygments.lexers.python import PythonLexer

    def broken(self, text):
        raise RuntimeError("lexer bug")
        yield

    monkeypatch.setattr(PythonLexer, "get_tokens_unprocessed", broken)
    assert predict(SOURCE, "Rename the class Item to Product.", "stock.py") is None


def test_a_position_in_the_prompts_copy_maps_to_the_prediction():
    """Equal stretches map one to one; the first position of a changed stretch maps to
    the start of its replacement; a position inside it (the output wrote the original
    there) maps nowhere; outside the prompt's copy, nowhere."""
    original = [10, 11, 12, 13, 14, 15]
    prediction = [10, 11, 20, 21, 22, 14, 15]  # 12, 13 -> 20, 21, 22
    p = Predicted(original, prediction)
    p.locate([1, 2, *original, 3])
    assert [p.moved(i) for i in range(10)] == [None, None, 0, 1, 2, None, 5, 6, None, None]


def _drafter(original, prediction=None, renamed=(), text=None):
    d = NgramDrafter(3, 12, extra=original, prediction=prediction, renamed=renamed, text=text)
    return d


def test_the_drafter_copies_a_rename_before_the_output_has_made_it():
    """With a prediction the draft crosses the first rename site with the new name;
    without one it copies the old name (and the draft would break there)."""
    original = list(range(100, 160))
    prediction = [*original[:30], 999, *original[31:]]  # token 130 renamed to 999
    prompt = [1, 2, *original, 3, 4]
    out = prediction[:20]
    plain = _drafter(original)
    plain.begin(prompt)
    assert plain.draft([*prompt, *out], 20).tokens == original[20:40]
    ahead = _drafter(original, prediction)
    ahead.begin(prompt)
    assert ahead.draft([*prompt, *out], 20).tokens == prediction[20:40]
    assert 999 in prediction[20:40]


def test_an_old_name_the_prediction_kept_stops_the_draft_until_the_output_shows_the_way():
    """A prose occurrence of an old name (kept by the prediction) is unsure: the draft
    stops before it, and the target decides there."""
    texts = {t: f" w{t}" for t in range(100, 200)}
    texts[130] = " Item"  # the old name, kept in prose
    original = list(range(100, 160))
    prompt = [1, 2, *original, 3, 4]
    d = _drafter(original, prediction=[*original[:50], 999, *original[51:]], renamed=["Item"],
                 text=lambda t: texts.get(t, "?"))
    d.begin(prompt)
    assert d.draft([*prompt, *original[:20]], 20).tokens == original[20:30]
    without = _drafter(original, prediction=[*original[:50], 999, *original[51:]],
                       text=lambda t: texts.get(t, "?"))
    without.begin(prompt)
    assert without.draft([*prompt, *original[:20]], 20).tokens == original[20:40]


EDIT_FILE = '''class Item:
    """A line of stock."""

    def __init__(self, name, count):
        self.name = name
        self.count = count


def restock(item: Item, n: int) -> Item:
    return Item(item.name, item.count + n)
'''


def test_the_runtime_predicts_an_edits_rename_in_the_targets_tokens(smol):
    """make_drafter (what `localspec edit` and the bench call) gives the n-gram drafter
    the file renamed in the target's tokens: after the output's first tokens, a draft
    runs on past the signature that uses the class, with the new name."""
    from localspec.core.config import SamplingConfig, SpecConfig
    from localspec.runtime import make_drafter

    spec = SpecConfig(mode="ngram", ngram_min=3, ngram_max=12)
    tok = lambda s: smol.tokenize(s, add_special=False, parse_special=False)  # noqa: E731
    file_tokens = tok(EDIT_FILE)
    prompt = [*tok("Rewrite this file:\n```python\n"), *file_tokens, *tok("\n```\n```python\n")]
    renamed = EDIT_FILE.replace("Item", "Product")
    out = tok(renamed)
    start = len(tok(renamed.split("def restock")[0]))  # the output so far: up to the function
    ahead = make_drafter(spec, SamplingConfig(), None, file_tokens, target=smol,
                         instruction="Rename the class Item to Product everywhere.", filename="stock.py")
    ahead.begin(prompt)
    draft = ahead.draft([*prompt, *out[:start]], 64).tokens
    assert "def restock(item: Product, n: int) -> Product:" in smol.detokenize(draft)
    plain = make_drafter(spec, SamplingConfig(), None, file_tokens, target=smol)
    plain.begin(prompt)
    assert "def restock(item: Item, n: int) -> Item:" in smol.detokenize(plain.draft([*prompt, *out[:start]], 64).tokens)
