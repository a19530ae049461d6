"""auto over many short generations, as a server's completion requests are (a keystroke's
/infill: a few dozen tokens): what it learned is kept from one request to the next, and
a stalled round does not stop it drafting. Modelled costs (a verify of n tokens costs
V(n) one-token times), not timed; one real-model check that the server shares it."""

from __future__ import annotations

import math
import random
import threading

from localspec.core.backend import Model
from localspec.core.config import GenerationConfig, ModelConfig, SamplingConfig, SpecConfig
from localspec.core.drafters.auto import AutoDrafter, Learned
from localspec.core.drafters.costs import CostModel, extend
from localspec.core.drafters.ngram import NgramDrafter
from localspec.serve.jobs import Failed, Finished, Job
from localspec.serve.scheduler import Scheduler, SchedulerConfig

# Qwen2.5-Coder 0.5B after a 1,400-token context on a 2-core AVX-512 EPYC (measured
# 2026-12-03): a verify costs nearly its length, so only sure drafts pay
V_05B = {1: 1.0, 2: 1.84, 3: 2.35, 4: 2.7, 5: 3.55, 6: 4.0, 7: 4.4, 8: 4.6, 9: 5.6, 10: 6.0, 12: 6.2,
         16: 7.6, 20: 9.6, 24: 11.5, 32: 14.0, 64: 27.0, 128: 52.0}
T1 = 0.025  # seconds per modelled one-token decode


def _curve(n_max: int = 200) -> list[float]:
    sizes = sorted(V_05B)
    return list(extend(sizes, [V_05B[m] for m in sizes], n_max))


V = _curve()


def _simulate(prompt: list[int], out: list[int], drafter: AutoDrafter, *, stall_at: int | None = None,
              seed: int = 0) -> tuple[float, list[int]]:
    """(modelled time in one-token times, each round's draft length) of greedy output
    `out` after `prompt`. Round `stall_at` takes 40x its cost in wall time (another
    process had the cores), which its modelled time does not count: it stalls plain
    decoding alike."""
    rng = random.Random(seed)
    drafter.begin(prompt)
    tokens, done, total, drafts = [*prompt, out[0]], 1, 0.0, []
    while done < len(out):
        d = drafter.draft(tokens, min(32, len(out) - done - 1))
        n = len(d.tokens)
        a = 0
        while a < n and d.tokens[a] == out[done + a]:
            a += 1
        cost = V[n] * math.exp(rng.gauss(0, 0.05))
        total += cost
        drafter.observe(n, a, T1 * cost * (40 if len(drafts) == stall_at else 1), 0.0)
        drafts.append(n)
        tokens += out[done : done + a + 1]
        done += a + 1
    drafter.end()
    return total, drafts


def _completion(seed: int, n_prompt: int = 600, n_out: int = 30) -> tuple[list[int], list[int]]:
    """(prompt, output): the output repeats a span of the prompt, one token in ~12
    changed (a completion that follows a pattern of the code around the cursor)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(2, 5000) for _ in range(n_prompt)]
    i, out = rng.randrange(0, n_prompt - 200), []
    while len(out) < n_out:
        if rng.random() < 1 / 12:
            out.append(rng.randrange(5000, 6000))
        else:
            out.append(prompt[i])
            i += 1
    return prompt, out


def _requests(learned: Learned | None, n: int = 30) -> list[tuple[float, list[int], int]]:
    """(modelled time, draft lengths, plain decoding's time) of n short requests, each
    with a new AutoDrafter (as the server makes one per request)."""
    out = []
    for r in range(n):
        prompt, reply = _completion(r)
        auto = AutoDrafter(NgramDrafter(1, 4), None, None, k_max=32, learned=learned)
        t, drafts = _simulate(prompt, reply, auto, seed=r)
        out.append((t, drafts, len(reply) - 1))
    return out


def test_short_requests_start_from_what_earlier_ones_learned():
    fresh, shared = _requests(None), _requests(Learned())
    # a fresh drafter has no one-token time for its first three rounds, so it cannot
    # weigh a draft yet: every request began with three plain rounds
    assert all(drafts[:3] == [0, 0, 0] for _, drafts, _ in fresh)
    # sharing, every request after the first drafts from its first round where it can
    later = [drafts for _, drafts, _ in shared[1:]]
    assert sum(1 for drafts in later if drafts[0] > 0) >= len(later) // 2
    plain = sum(p for _, _, p in fresh)
    t_fresh, t_shared = sum(t for t, _, _ in fresh), sum(t for t, _, _ in shared)
    assert t_shared < 0.95 * t_fresh and t_shared < 0.9 * plain


def test_a_stalled_round_does_not_stop_drafting():
    # a long copy (an edit-like completion) where one early draft round stalls: the
    # round's time says nothing of the draft, so drafting goes on
    rng = random.Random(3)
    prompt = [rng.randrange(2, 5000) for _ in range(400)]
    reply = prompt[100:300]
    t_calm, drafts = _simulate(prompt, reply, AutoDrafter(NgramDrafter(1, 4), None, None, k_max=32))
    first = next(i for i, n in enumerate(drafts) if n)
    assert first < 8
    t, drafts = _simulate(prompt, reply, AutoDrafter(NgramDrafter(1, 4), None, None, k_max=32),
                          stall_at=first)
    after = drafts[first + 1:]
    assert sum(1 for n in after if n) > 0.8 * len(after)
    assert t < 1.2 * t_calm and t < 0.5 * (len(reply) - 1)


def test_the_servers_requests_share_one_learned_cost_model(smol_path, monkeypatch):
    # the scheduler's drafters (make_drafter, auto) keep one Learned: the verify times
    # of every request land in one cost model, and the second request starts with the
    # first one's one-token time
    timed: dict[int, int] = {}  # cost model -> verify times it was given
    observe = CostModel.observe_verify

    def counting(self, n, seconds):
        timed[id(self)] = timed.get(id(self), 0) + 1
        observe(self, n, seconds)

    monkeypatch.setattr(CostModel, "observe_verify", counting)
    model = Model(ModelConfig(path=smol_path, n_ctx=1024, n_seq_max=1, n_threads=1))
    spec = SpecConfig(mode="auto", draft_max=8)
    sched = Scheduler(model, SchedulerConfig(n_slots=1, spec=spec, spec_disable_by_batch_size=-1))
    sched.start()
    rounds = []
    try:
        for text in ("Count: one two three four five six seven", "Colours: red green blue red green"):
            done = threading.Event()
            got: list[object] = []

            def sink(ev: object, got=got, done=done) -> None:
                got.append(ev)
                if isinstance(ev, (Finished, Failed)):
                    done.set()

            gen = GenerationConfig(max_tokens=24)
            sched.submit(Job(model.tokenize(text), SamplingConfig(), gen, sink=sink))
            assert done.wait(120)
            assert isinstance(got[-1], Finished)
            rounds.append(got[-1].stats.rounds)
            if len(rounds) == 1:
                assert sched.learned.cost is not None and sched.learned.cost.t1() is not None
    finally:
        sched.stop()
        model.close()
    assert timed == {id(sched.learned.cost): sum(rounds)}  # both requests' rounds, in one model


def test_a_servers_request_does_not_stake_its_gains_on_a_trial():
    # colorsys' /infill in the benchmark: four rounds fully accepted (k 1, 1, 4, 4), then
    # a 16-token draft at a size never verified, rejected at once: 9.5 one-token times
    # for one token, and the 500 ms request ended behind plain decoding. A generation
    # alone may stake what it gained; a server's request, whose trial serves every later
    # request, risks only the budget
    for learned, takes in ((None, True), (Learned(), False)):
        auto = AutoDrafter(NgramDrafter(1, 4), None, None, k_max=32, learned=learned)
        for n, v in ((1, 1.0), (5, 3.55)) * 3:
            auto.cost.observe_verify(n, T1 * v)
        auto.lost, auto.tried, auto.produced = -3.5, -5.0, 17  # ahead of plain and of the best known
        assert not auto.cost.known(17) and auto.cost.upper(17) > 15
        assert auto._affordable(17, 12.0, 0.0, 1.2) is takes
