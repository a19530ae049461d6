"""An edit's settings drafted ahead (core/drafters/settings.py, through renames.predict):
"set KEY to VALUE", "increase every KEY by N", "add KEY: VALUE to every X object" read
from the instruction and made in the file, in the file's own style. Pure, but for the
last test (SmolLM2's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localspec.core.drafters.renames import predict
from localspec.core.drafters.settings import Setting, parse

CORPUS = Path(__file__).resolve().parent.parent / "scripts" / "edit_corpus"


@pytest.mark.parametrize("instruction, settings", [
    ("Set debug to false and add \"timeout_s\": 30 to every service object. Keep the formatting.",
     [Setting("debug", "false"), Setting("timeout_s", "30", within="service")]),
    ("Set LOG_LEVEL to \"debug\" in every service and increase every port by 1000.",
     [Setting("LOG_LEVEL", '"debug"'), Setting("port", by=1000)]),
    ("set the value of `retries` to 5", [Setting("retries", "5")]),
    ("Decrease all ports by 10 everywhere.", [Setting("ports", by=-10)]),
])
def test_an_instruction_that_sets_keys_is_read(instruction, settings):
    assert parse(instruction) == settings


@pytest.mark.parametrize("instruction", [
    "Set the timeout to 30 in the auth service.",  # narrowed: wrong everywhere else
    "Set the indentation to 4 spaces.",  # no key: what follows the value is no scope
    "Add a short docstring to every function that lacks one.",
    "Rename the class Item to Product.",
])
def test_an_instruction_that_sets_nothing_certain_is_not_read(instruction):
    assert parse(instruction) == []


@pytest.mark.parametrize("name", ["deploy.json", "services.json"])
def test_a_config_edit_is_foretold_exactly(name):
    """The corpus's two config edits (a value set, a number raised, a key added to each
    object of a list, both inline and one member a line): the prediction is the edit
    done right, byte for byte."""
    import json

    task = next(t for t in map(json.loads, (CORPUS / "tasks.jsonl").read_text().splitlines()) if t["file"] == name)
    r = predict((CORPUS / name).read_text(), task["instruction"], name)
    assert r is not None and r.old == ()
    assert r.text == (CORPUS / task["after"]).read_text()


JSON = '''{
  "debug": true,
  "note": "set \\"debug\\": true to debug",
  "services": [
    {"name": "auth", "port": 8001},
    {
      "name": "billing",
      "port": 8002,
      "env": {"level": "info"}
    },
    {"name": "search", "timeout_s": 5}
  ],
  "workers": [{"name": "w1"}]
}
'''


def test_json_values_set_and_keys_added_in_the_objects_own_layout():
    r = predict(JSON, 'Set debug to false, increase every port by 1000 and add "timeout_s": 30 '
                      'to every service.', "app.json")
    assert r is not None
    assert r.text == JSON.replace('"debug": true,', '"debug": false,', 1) \
        .replace("8001}", '9001, "timeout_s": 30}').replace('"port": 8002', '"port": 9002') \
        .replace('"info"}\n', '"info"},\n      "timeout_s": 30\n')


def test_other_files_keep_their_own_spelling_of_values():
    """Python's `True` where it writes `True` and no annotation taken for a setting;
    YAML's quotes kept; a comment left alone."""
    py = 'DEBUG = True\nlevel: str = "x"\nCONFIG = {"level": "info"}  # level: info\n'
    r = predict(py, "Set DEBUG to false and set level to \"debug\".", "settings.py")
    assert r is not None and r.text == 'DEBUG = False\nlevel: str = "x"\nCONFIG = {"level": "debug"}  # level: info\n'
    yaml = "server:\n  level: 'info'  # level: info\n  port: 80\n"
    r = predict(yaml, "set level to debug and bump every port by 8000", "app.yaml")
    assert r is not None and r.text == "server:\n  level: 'debug'  # level: info\n  port: 8080\n"


def test_a_setting_the_file_does_not_have_gives_no_prediction():
    assert predict('{"a": 1}\n', "Set debug to false.", "x.json") is None
    assert predict('{"a": 1}\n', "Set a to 1.", "x.json") is None  # already so


def test_the_runtime_drafts_an_added_key_before_the_output_has_written_one(smol):
    """make_drafter (what `localspec edit` calls) gives the n-gram drafter the config with
    its keys added: at the first object's end, the draft goes on with the new key."""
    from localspec.core.config import SamplingConfig, SpecConfig
    from localspec.runtime import make_drafter

    spec = SpecConfig(mode="ngram", ngram_min=3, ngram_max=12)
    tok = lambda s: smol.tokenize(s, add_special=False, parse_special=False)  # noqa: E731
    text = (CORPUS / "services.json").read_text()
    instruction = 'Set debug to false and add "timeout_s": 30 to every service object.'
    file_tokens = tok(text)
    prompt = [*tok("Rewrite this file:\n```json\n"), *file_tokens, *tok("\n```\n```json\n")]
    done = predict(text, instruction, "services.json").text
    out = tok(done)
    # the output so far: up to the first service's last value
    head = next(out[:n] for n in range(len(out)) if '"/healthz"' in smol.detokenize(out[:n]))
    ahead = make_drafter(spec, SamplingConfig(), None, file_tokens, target=smol,
                         instruction=instruction, filename="services.json")
    ahead.begin(prompt)
    assert '"timeout_s": 30}' in smol.detokenize(ahead.draft([*prompt, *head], 32).tokens)
    plain = make_drafter(spec, SamplingConfig(), None, file_tokens, target=smol)
    plain.begin(prompt)
    assert "timeout_s" not in smol.detokenize(plain.draft([*prompt, *head], 32).tokens)
