"""Flash attention on or off: the backend rebuilds an empty context either way, and runs
with -fa auto use the verdict `tune` stored (tune's timing of both: test_tune.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from localspec.core.backend import Model
from localspec.core.config import LoadOptions, ModelConfig
from localspec.runtime import open_runtime, setup_of
from localspec.profile import Profile, save_profile


def _opts(path: str, flash_attn: str = "auto") -> LoadOptions:
    return LoadOptions(model=path, draft=None, n_ctx=512, n_threads=1, n_gpu_layers=0,
                       n_gpu_layers_draft=0, flash_attn=flash_attn)


def test_set_flash_attn_rebuilds_an_empty_context_that_decodes_alike(smol_path):
    m = Model(ModelConfig(smol_path, n_ctx=512, n_threads=1, n_gpu_layers=0, flash_attn="on"))
    try:
        prompt = m.tokenize("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
        with_fa = np.array(m.decode(prompt, "all"))
        with pytest.raises(ValueError, match="empty context"):
            m.set_flash_attn("off")  # the cells hold the prompt: a new context would lose them
        assert m.flash_attn == "on"
        m.rewind(0)
        m.set_flash_attn("off")
        assert m.flash_attn == "off" and m.n_past == 0
        without = np.array(m.decode(prompt, "all"))
        # the same model through the other attention kernel: the same choices, logits that
        # differ only by rounding
        assert (with_fa.argmax(axis=1) == without.argmax(axis=1)).mean() > 0.9
        assert np.abs(with_fa - without).mean() < 0.2 * np.abs(with_fa).mean()
        assert np.abs(with_fa).max() > 1.0  # real logits, not an empty buffer
        assert not np.array_equal(with_fa[1:], without[1:])  # ... from the other kernel
    finally:
        m.close()


def test_runs_with_fa_auto_use_what_tune_measured(smol_path):
    with open_runtime(_opts(smol_path), want_draft=False) as rt:
        assert rt.target.flash_attn == "auto"  # no profile: llama.cpp's own choice
        setup = setup_of(rt.target)
    save_profile(Profile(key=setup.key, target="t", draft=None, device=setup.device,
                         n_threads=setup.n_threads, n_gpu_layers=setup.n_gpu_layers, t_token_s=0.01,
                         vcurve=[1.0, 1.5], prefill_tok_s=100.0, flash_attn="off"))
    with open_runtime(_opts(smol_path), want_draft=False) as rt:
        assert rt.target.flash_attn == "off"
        logits, _ = rt.target.prefill(rt.target.tokenize("hello"))
        assert np.isfinite(logits).all()
    # a forced setting wins, and is measured apart: its profile key is not auto's
    with open_runtime(_opts(smol_path, "on"), want_draft=False) as rt:
        assert rt.target.flash_attn == "on"
        assert setup_of(rt.target).key != setup.key
        assert setup_of(rt.target).key == replace(setup, flash_attn="on").key


def test_tune_measures_again_what_an_earlier_tune_chose(smol_path, monkeypatch):
    # open_runtime applies a stored verdict before tune runs: calibrate must time both
    # settings again (-fa auto as asked), not keep the setting the model was left on
    from localspec.bench import calibrate

    asked = []

    def measured(model, reps=3):
        asked.append(model.flash_attn)
        model.set_flash_attn("off")
        return "off", {"on": 2.0, "off": 1.0}

    monkeypatch.setattr(calibrate, "measure_flash_attn", measured)
    with open_runtime(_opts(smol_path), want_draft=False) as rt:
        rt.target.set_flash_attn("on")  # what an earlier tune stored, applied at load
        profile = calibrate.calibrate(rt.target, None, setup_of(rt.target), n_max=2)
    assert asked == ["on"] and profile.flash_attn == "off"
