"""Glue between the commands and the engine: load the target (and draft), check the
pair, build the drafter. Shared by run, edit, chat, bench and serve."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localspec import models
from localspec.commands.options import LoadOptions
from localspec.core.backend import Model
from localspec.core.compat import check_pair
from localspec.core.config import ModelConfig, SamplingConfig, SpecConfig
from localspec.core.drafters import Drafter, HybridDrafter, NgramDrafter, NoDrafter
from localspec.core.drafters.auto import AutoDrafter
from localspec.core.drafters.model import ModelDrafter
from localspec.core.errors import UsageError
from localspec.models.profile import load_profile, store_online


@dataclass
class Runtime:
    target: Model
    draft: Model | None = None

    def close(self) -> None:
        for m in (self.draft, self.target):
            if m is not None:
                m.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_runtime(opts: LoadOptions, *, want_draft: bool, n_seq_max: int = 1) -> Runtime:
    """Resolve and load the models; the draft only when `want_draft` and one is named."""
    target_path = models.resolve(opts.model, role="target")
    draft_path = None
    if want_draft and opts.draft and opts.draft.lower() != "none":
        draft_path = models.resolve(opts.draft, role="draft")
    target = Model(ModelConfig(
        path=str(target_path), n_ctx=opts.n_ctx, n_threads=opts.n_threads,
        n_gpu_layers=opts.n_gpu_layers, n_seq_max=n_seq_max, verbose=opts.verbose,
    ))
    if draft_path is None:
        return Runtime(target)
    try:
        draft = Model(ModelConfig(
            path=str(draft_path), n_ctx=opts.n_ctx, n_threads=opts.n_threads,
            n_gpu_layers=opts.n_gpu_layers_draft, verbose=opts.verbose,
        ))
        check_pair(target, draft)
    except BaseException:
        target.close()
        raise
    return Runtime(target, draft)


def make_drafter(
    spec: SpecConfig,
    sampling: SamplingConfig,
    draft_model: Model | None,
    extra: Sequence[int] = (),
    target: Model | None = None,
) -> Drafter:
    """The drafter for `spec.mode`; `extra` is a second n-gram source (a file's tokens).
    `auto` uses the calibration profile of `target` (and the draft) when one exists,
    and stores the verify costs each generation measured into it."""
    if spec.mode == "none":
        return NoDrafter()
    ngram = NgramDrafter(spec.ngram_min, spec.ngram_max, extra)
    if spec.mode == "ngram":
        return ngram
    model = ModelDrafter(draft_model, sampling, spec.draft_p_min) if draft_model else None
    if spec.mode == "auto":
        if target is None:
            return AutoDrafter(ngram, model, None, k_max=max(1, spec.draft_max))
        return AutoDrafter(ngram, model, load_profile(target, draft_model, online=True),
                           k_max=max(1, spec.draft_max),
                           store=lambda measured, t1: store_online(target, draft_model, measured, t1))
    if model is None:
        raise UsageError(f"--spec {spec.mode} needs a draft model (--draft)")
    return model if spec.mode == "model" else HybridDrafter(ngram, model)


def chat_prompt(model: Model, user: str, system: str | None = None) -> list[int]:
    """Tokens for one user message under the model's chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return model.tokenize(model.apply_chat_template(messages), add_special=True, parse_special=True)
