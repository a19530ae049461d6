"""The named parts shared by every caller: modes and stop reasons (their values are the
strings that go on the wire and into logs), where adaptive k is decided, prefix reuse,
the event transcript and edit's fence stop."""

from __future__ import annotations

import inspect
import json

import pytest
from fakes import FakeModel

from localspec.core.config import SpecConfig, SpecMode
from localspec.core.drafters.ngram import NgramDrafter
from localspec.core.engine import AdaptiveK, generate
from localspec.core.events import Done, GenerationStats, StopReason, Token, Transcript
from localspec.edit import FenceStop


def test_modes_and_stop_reasons_read_as_their_strings():
    stats = GenerationStats(stop_reason=StopReason.EOS)
    assert json.dumps({"mode": SpecMode.AUTO, "stop": stats.to_dict()["stop_reason"]}) == \
        '{"mode": "auto", "stop": "eos"}'
    assert f"{SpecMode.NGRAM:>6}|{StopReason.LENGTH}" == " ngram|length"
    assert {"auto": 1}[SpecMode.AUTO] == 1 and StopReason.CANCELLED == "cancelled"


def test_a_mode_given_as_text_is_the_enum_and_an_unknown_one_is_refused():
    assert SpecConfig(mode="hybrid").mode is SpecMode.HYBRID
    with pytest.raises(ValueError):
        SpecConfig(mode="copy")


def test_one_answer_for_which_modes_use_the_draft_model():
    assert {m for m in SpecMode if m.uses_draft_model} == {SpecMode.AUTO, SpecMode.MODEL, SpecMode.HYBRID}
    assert {m for m in SpecMode if m.needs_draft_model} == {SpecMode.MODEL, SpecMode.HYBRID}
    assert [m for m in SpecMode if not m.drafts] == [SpecMode.NONE]


def test_adaptive_k_is_decided_by_the_spec_and_off_where_auto_chooses_k():
    for mode in SpecMode:
        spec = SpecConfig(mode=mode, draft_max=32, adaptive=True)
        assert spec.adapts_k == (mode is not SpecMode.AUTO)
        assert AdaptiveK(spec).k == (32 if mode is SpecMode.AUTO else 8)  # adaptive starts at 8
    assert not SpecConfig(mode="ngram", adaptive=False).adapts_k  # --fixed-k


def test_reuse_prefix_keeps_the_shared_start_and_can_redo_the_last_token():
    model = FakeModel()
    model.decode(list(range(1, 11)), "last")
    assert model.reuse_prefix([1, 2, 3, 99]) == 3 and model.cached == model.cells == [1, 2, 3]
    assert model.reuse_prefix([1, 2, 3], redo_last=True) == 2 and model.cached == [1, 2]
    assert model.reuse_prefix([7]) == 0 and model.cached == []


def test_a_transcript_gathers_the_events_and_closes_the_generation():
    model = FakeModel()
    events = generate(model, [1, 2, 3, 4], NgramDrafter())
    with Transcript(events) as run:
        for ev in run:
            if isinstance(ev, Token):
                break  # the consumer stops early
    assert inspect.getgeneratorstate(events) == inspect.GEN_CLOSED
    assert len(run.ids) == 1 and run.stats is None
    with Transcript(generate(model, [1, 2, 3, 4], NgramDrafter())) as run:
        evs = list(run)
    assert isinstance(evs[-1], Done) and run.stats is evs[-1].stats
    assert run.text == "".join(e.text for e in evs if isinstance(e, (Token, Done)))


def test_fence_stop_cuts_the_answer_at_the_closing_fence_line():
    stop = FenceStop("```")
    for i, text in enumerate(["hello\n", "```", "\n", "more"]):
        assert not stop.done or i == 3
        stop.add(Token(i, text, False))
    assert stop.done and stop.cut == 3  # the fourth token came in the same round: not part of it
    assert stop.body() == "hello" and stop.reply == "hello\n```\n"
