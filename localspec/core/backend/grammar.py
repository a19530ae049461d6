"""Structured output: llama.cpp's grammar sampler (GBNF), and JSON schema -> GBNF
(validated with jsonschema, converted by llama-cpp-python's converter). The engine asks a Grammar which tokens may
come next and tells it which token was accepted; everything else (which token is chosen,
how speculation stays lossless) is the engine's.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence

import numpy as np

from localspec.core.backend.gbnf_check import check_gbnf
from localspec.core.backend.ggml import Owned, _ll, captured
from localspec.core.backend.schema_check import check_schema_bounds
from localspec.core.backend.llama_model import Model
from localspec.core.errors import GrammarError

_lg = _ll.llama_grammar  # llama-cpp-python's GBNF rules and JSON-schema converter

JSON_GBNF = _lg.JSON_GBNF  # {"type": "json_object"}: any JSON object

# llama-cpp-python 0.3.36's converter lets a string hold raw control characters (a newline
# inside quotes), which strict JSON parsers reject; llama.cpp's current rule does not
_LOOSE_CHAR = "char ::= " + _lg.PRIMITIVE_RULES["char"].content
_STRICT_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'

# llama_token_data {id, logit, p} as a numpy record, so a candidate array is one buffer
_CANDIDATE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _CANDIDATE.itemsize == ctypes.sizeof(_ll.llama_token_data)


def _reason(said: list[str]) -> str:
    """llama.cpp's complaint in one line. Its parser prints "parse: error parsing grammar:
    WHY" and then the whole grammar (dropped here); other checks log one line."""
    stderr, logged = said[0].strip().splitlines(), "".join(said[1:]).splitlines()
    lines = [stderr[0].replace("parse: error parsing grammar: ", "")] if stderr else []
    lines += [ln.strip() for ln in logged if ln.strip() and "failed to parse grammar" not in ln]
    return "; ".join(dict.fromkeys(lines)) or "llama.cpp rejected it"


class Grammar(Owned):
    """llama.cpp's grammar sampler for one generation, over `model`'s vocabulary.

    allowed(ids) / allows(token) ask which candidates the grammar lets come next (one C
    call for any number of them, cheap for a few); mask(row) applies it to a whole row of
    logits (the whole vocabulary: tens of ms for 150k tokens); accept(token) advances the
    state. Free with close() (or let it be collected).
    """

    def __init__(self, model: Model, text: str, root: str = "root") -> None:
        self.n_vocab = model.n_vocab
        self.text, self.root = text, root
        if not text.strip():
            raise GrammarError("invalid grammar: it is empty")
        check_gbnf(text, root)  # what llama.cpp's parser cannot survive never reaches it
        with captured() as said:
            smpl = _ll.llama_sampler_init_grammar(model.llama_vocab, text.encode(), root.encode())
        if not smpl:
            raise GrammarError(f"invalid grammar: {_reason(said)}")
        self._smpl = smpl
        self._scratch()

    def _scratch(self) -> None:
        self._one = _ll.llama_token_data()  # allows(): one candidate, its array made once
        self._one_arr = _ll.llama_token_data_array(ctypes.pointer(self._one), 1, -1, False)
        self._one_ref = ctypes.byref(self._one_arr)
        self._all: np.ndarray | None = None  # the whole vocabulary, built on first mask()

    def _apply(self, cand: np.ndarray) -> np.ndarray:
        """Which of the candidate records the grammar allows (their logits are zeroed
        here; llama.cpp sets the forbidden ones to -inf)."""
        cand["logit"] = 0.0
        arr = _ll.llama_token_data_array(cand.ctypes.data_as(_ll.llama_token_data_p), len(cand), -1, False)
        _ll.llama_sampler_apply(self._smpl, ctypes.byref(arr))
        return cand["logit"] == 0.0

    def allowed(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """A boolean per id: may it come next?"""
        cand = np.zeros(len(ids), dtype=_CANDIDATE)
        cand["id"] = ids
        return self._apply(cand)

    def allows(self, token: int) -> bool:
        """May `token` come next? (~10 us: one candidate, its array made once)"""
        one = self._one
        one.id, one.logit = token, 0.0
        _ll.llama_sampler_apply(self._smpl, self._one_ref)
        return one.logit == 0.0

    def allowed_all(self) -> np.ndarray:
        """A boolean per vocabulary id (the expensive call: every token's text)."""
        if self._all is None:
            self._all = np.zeros(self.n_vocab, dtype=_CANDIDATE)
            self._all["id"] = np.arange(self.n_vocab)
        return self._apply(self._all)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of a row of logits with -inf where the grammar forbids the token."""
        return np.where(self.allowed_all(), logits, -np.inf).astype(logits.dtype, copy=False)

    def accept(self, token: int) -> None:
        """Advance over an accepted token. llama.cpp aborts the process on a token its
        grammar forbids, so that is checked first (and raised here instead)."""
        if not self.allows(token):
            raise GrammarError(f"token {token} is not allowed by the grammar here")
        _ll.llama_sampler_accept(self._smpl, token)

    def clone(self) -> Grammar:
        """An independent copy of this grammar in its current state."""
        twin = object.__new__(Grammar)
        twin.__dict__.update(self.__dict__)
        twin._smpl = _ll.llama_sampler_clone(self._smpl)
        twin._scratch()
        return twin

    def reset(self) -> None:
        """Back to the start of the grammar."""
        _ll.llama_sampler_reset(self._smpl)

    def close(self) -> None:
        if getattr(self, "_smpl", None):
            _ll.llama_sampler_free(self._smpl)
            self._smpl = None


def check_grammar(model: Model, text: str) -> None:
    """Raise GrammarError unless llama.cpp accepts `text` for `model`'s vocabulary."""
    Grammar(model, text).close()


def json_schema_grammar(schema: object) -> str:
    """GBNF for JSON that validates against `schema` (a JSON Schema object), through
    llama-cpp-python's converter; GrammarError for a schema past the bounds
    (schema_check.py, then gbnf_check.py on the grammar), invalid (checked with
    `jsonschema` against its metaschema) or that the converter cannot express."""
    import jsonschema  # well-kept metaschema checks; imported only when a schema is used

    if not isinstance(schema, dict):
        raise GrammarError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
    check_schema_bounds(schema)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise GrammarError(f"invalid JSON schema{f' at {where}' if where else ''}: {exc.message}") from None
    except RecursionError:  # the bounds keep it from happening; a 400 all the same
        raise GrammarError("invalid JSON schema: it nests too deeply") from None
    try:
        gbnf = _lg.json_schema_to_gbnf(json.dumps(schema))
    except RecursionError:
        raise GrammarError("unsupported JSON schema: it nests too deeply") from None
    except Exception as exc:  # noqa: BLE001 - the converter asserts and raises anything
        raise GrammarError(f"unsupported JSON schema: {exc}") from None
    gbnf = gbnf.replace(_LOOSE_CHAR, _STRICT_CHAR)
    check_gbnf(gbnf)
    return gbnf
