"""On a GPU build (CUDA, Metal): the default pair is fully offloaded, greedy speculation
is exact there, and the speedups are printed (measured side by side, never asserted).

Skipped on CPU-only builds. Run with `pytest -m gpu -s` (scripts/gpu-check.sh does).
"""

from __future__ import annotations

import pytest
from test_real_models import EDIT_SOURCE, assert_same_greedy, plain_greedy

from localspec.commands.doctor import devices, model_report, offload_devices
from localspec.core.backend import Model, supports_gpu_offload
from localspec.core.config import (
    GenerationConfig,
    ModelConfig,
    SamplingConfig,
    SpecConfig,
)
from localspec.core.drafters import HybridDrafter, NgramDrafter, NoDrafter
from localspec.core.drafters.draft_model import ModelDrafter
from localspec.core.engine import collect, generate
from localspec.core.chat_template import chat_prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not supports_gpu_offload(), reason="llama.cpp built without GPU offload"),
]

GREEDY = SamplingConfig(temperature=0.0)
CODE_PROMPT = "Write a Python function that parses an ISO 8601 date string without using datetime."
EDIT_INSTRUCTION = "Rename the function total to sum_prices. Output the whole code."
SPEED_TOKENS = 192


def _gpu() -> list[dict]:
    return offload_devices(devices())


def _run(target, prompt, drafter, n, draft_model=None, **spec):
    ids, _, stats = collect(generate(
        target, prompt, drafter, sampling=GREEDY, spec=SpecConfig(**spec),
        gen=GenerationConfig(max_tokens=n), draft_model=draft_model,
    ))
    return ids, stats


def test_default_pair_is_fully_offloaded(qwen_target, qwen_draft):
    gpu = _gpu()
    assert gpu, "the build reports GPU offload but no GPU device"
    for model, role in ((qwen_target, "target"), (qwen_draft, "draft")):
        report = model_report(model, role, model.cfg.n_gpu_layers, gpu)
        print(f"{role}: {report['placement']}")
        assert model.cfg.n_gpu_layers == -1  # the default
        assert report["layers_offloaded"] == report["layers_total"], report


def test_explicit_layer_count_is_partial(smol_path):
    with Model(ModelConfig(path=smol_path, n_ctx=256, n_gpu_layers=5)) as m:
        report = model_report(m, "target", 5, _gpu())
        assert report["layers_offloaded"] == 5 and "on CPU" in report["placement"], report
        rows = m.decode(m.tokenize("partial offload still decodes batches"), "all")
        assert rows.shape[0] > 3 and float(rows.max()) > 0


def test_greedy_speculation_is_exact_on_gpu(qwen_target, qwen_draft):
    prompt = chat_prompt(qwen_target, CODE_PROMPT)
    plain, margins = plain_greedy(qwen_target, prompt, 96)
    ids, stats = _run(qwen_target, prompt, ModelDrafter(qwen_draft, GREEDY, 0.0), 96, qwen_draft,
                      mode="model")
    assert_same_greedy(plain, margins, ids)
    assert stats.acceptance > 0.5, stats.to_dict()
    hybrid = HybridDrafter(NgramDrafter(1, 4), ModelDrafter(qwen_draft, GREEDY, 0.75))
    ids, _ = _run(qwen_target, prompt, hybrid, 96, qwen_draft, mode="hybrid")
    assert_same_greedy(plain, margins, ids)

    edit = chat_prompt(qwen_target, f"{EDIT_INSTRUCTION}\n\n```python\n{EDIT_SOURCE}```")
    plain, margins = plain_greedy(qwen_target, edit, 128)
    ids, stats = _run(qwen_target, edit, NgramDrafter(1, 4), 128, mode="ngram")
    assert_same_greedy(plain, margins, ids)
    assert stats.accepted > 0


def _speed_row(name: str, stats, base: float) -> str:
    per_round_us = (stats.decode_s - stats.llama_s) / max(stats.rounds, 1) * 1e6
    return (f"{name:<14} {stats.tokens_per_s:8.1f} tok/s  {stats.tokens_per_s / base:5.2f}x  "
            f"acc {stats.acceptance:6.1%}  tok/round {stats.tokens_per_round:5.2f}  "
            f"overhead {stats.overhead:6.1%}  outside llama.cpp {per_round_us:7.0f} us/round")


def test_speed_side_by_side(qwen_target, qwen_draft):
    """tok/s of plain decode vs each drafter, side by side in one process (greedy),
    printed, never asserted (times are the machine's). What is asserted makes the
    comparison fair and the drafting real: every run decodes plain decoding's greedy
    text (up to a near-tie), and on the edit (a copy of its source) every drafter
    has tokens accepted and takes fewer target rounds than plain decoding."""
    code = chat_prompt(qwen_target, CODE_PROMPT)
    edit = chat_prompt(qwen_target, f"{EDIT_INSTRUCTION}\n\n```python\n{EDIT_SOURCE}```")
    _run(qwen_target, code, NoDrafter(), 16, mode="none")  # warm-up: kernels, graphs
    lines = []
    for label, prompt in (("code", code), ("edit", edit)):
        plain_ids, margins = plain_greedy(qwen_target, prompt, SPEED_TOKENS)
        ids, plain = _run(qwen_target, prompt, NoDrafter(), SPEED_TOKENS, mode="none")
        assert_same_greedy(plain_ids, margins, ids)
        rows = [_speed_row("none", plain, plain.tokens_per_s)]
        for mode in ("ngram", "model", "hybrid"):
            ngram = NgramDrafter(1, 4)
            model = ModelDrafter(qwen_draft, GREEDY, 0.75)
            drafter = {"ngram": ngram, "model": model, "hybrid": HybridDrafter(ngram, model)}[mode]
            ids, stats = _run(qwen_target, prompt, drafter, SPEED_TOKENS,
                              qwen_draft if mode != "ngram" else None, mode=mode)
            assert_same_greedy(plain_ids, margins, ids)
            if label == "edit":
                assert stats.accepted > 0 and stats.rounds < plain.rounds, (mode, stats.to_dict())
            rows.append(_speed_row(mode, stats, plain.tokens_per_s))
        pair = f"{qwen_target.name} + {qwen_draft.name}"
        lines += [f"--- {label} prompt, {pair}, greedy, {SPEED_TOKENS} tokens"]
        lines += rows
    print("\n" + "\n".join(lines))
