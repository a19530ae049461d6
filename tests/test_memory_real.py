"""Memory drafts on a real model (SmolLM2): greedy output equals plain decoding's, with a
negative control that shows the comparison catches an accept rule that keeps wrong
drafted tokens."""

from __future__ import annotations

import pytest
from test_real_models import GREEDY, assert_same_greedy, plain_greedy

from localspec.core import engine
from localspec.core.config import GenerationConfig, SpecConfig
from localspec.core.drafters.auto import AutoDrafter
from localspec.core.drafters.memory import Memory, MemoryDrafter
from localspec.core.drafters.ngram import NgramDrafter
from localspec.core.engine import collect, generate
from localspec.core.chat_template import chat_prompt
from localspec.profile import Profile

N = 64


@pytest.fixture(scope="module")
def earlier(smol):
    """A request and its plain greedy reply, as an earlier request left them."""
    prompt = chat_prompt(smol, "Write a Python function that returns the squares of a list of numbers.")
    plain, margins = plain_greedy(smol, prompt, N)
    assert len(plain) > 32
    return prompt, plain, margins


def _poisoned(tokens: list[int]) -> list[int]:
    """The reply with every 9th token replaced: drafts from it go wrong there."""
    return [t if i % 9 != 5 else (t + 1) % 49152 for i, t in enumerate(tokens)]


def _spec(smol, prompt, drafter, mode="ngram"):
    ids, _, stats = collect(generate(smol, prompt, drafter, sampling=GREEDY,
                                     spec=SpecConfig(mode=mode, draft_max=16),
                                     gen=GenerationConfig(max_tokens=N)))
    return ids, stats


def test_memory_drafts_from_a_wrong_memory_are_rejected_losslessly(smol, earlier):
    prompt, plain, margins = earlier
    memory = Memory()
    memory.add(_poisoned(plain))
    ids, stats = _spec(smol, prompt, MemoryDrafter(memory, learn=False))
    assert_same_greedy(plain, margins, ids)
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # right and wrong tokens drafted


def test_negative_control_an_accept_all_rule_is_caught(smol, earlier, monkeypatch):
    prompt, plain, margins = earlier
    memory = Memory()
    memory.add(_poisoned(plain))
    monkeypatch.setattr(engine, "accept_greedy", lambda draft, target: (len(draft), int(target[len(draft)])))
    ids, _ = _spec(smol, prompt, MemoryDrafter(memory, learn=False))
    with pytest.raises(AssertionError, match="diverged"):
        assert_same_greedy(plain, margins, ids)


def test_auto_drafts_a_repeated_reply_from_memory_and_equals_plain(smol, earlier):
    prompt, plain, margins = earlier
    memory = Memory()
    memory.add(plain)  # the same question was answered before
    # the costs are given, not timed: whether drafting pays must not hang on this machine's
    # load while the test runs (V(n) = 1 + 0.3 (n - 1): a long right draft pays on any curve)
    curve = [1.0 + 0.3 * (n - 1) for n in range(1, 65)]
    profile = Profile(key="k", target="t", draft=None, device="cpu", n_threads=2, n_gpu_layers=0,
                      t_token_s=0.1, vcurve=curve, prefill_tok_s=100.0)
    auto = AutoDrafter(NgramDrafter(1, 4), None, profile, k_max=16, learn_costs=False,
                       memory=MemoryDrafter(memory))
    ids, stats = _spec(smol, prompt, auto, mode="auto")
    assert_same_greedy(plain, margins, ids)
    used = {k: v for k, v in stats.policy.items() if k.startswith("memory:")}
    assert used and sum(v["rounds"] for v in used.values()) > 2, stats.policy
    assert stats.accepted > len(plain) / 2
    assert len(memory.texts) > len(plain)  # and the reply joined the memory again
