"""Glue between the commands and the engine: load the target (and draft), check the
pair, find their calibration profile, build the drafter. Every command loads models
through here (run, edit, chat, bench, serve, tune, doctor)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from localspec import models
from localspec.acceptance import logdb
from localspec.core.backend import Model, supports_gpu_offload
from localspec.core.compat import check_pair
from localspec.core.config import LoadOptions, ModelConfig, SamplingConfig, SpecConfig, SpecMode
from localspec.core.drafters import Drafter, HybridDrafter, NgramDrafter, NoDrafter, renames, sites
from localspec.core.drafters.auto import AutoDrafter, Learned
from localspec.core.drafters.memory import Memory, MemoryDrafter, MemoryModel
from localspec.core.drafters.draft_model import DraftBatch, ModelDrafter
from localspec.core.errors import IncompatibleModels, LocalspecError, UsageError
from localspec.core.events import GenerationStats
from localspec.models.drafts import draft_candidates
from localspec.models.gguf_info import GGUFError, read_info
from localspec.profile import Profile, Setup, load_profile, model_id, store_online_later

AUTO_DRAFT_TRIES = 3  # loads at most this many header-compatible drafts before giving up


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
    """Resolve and load the models; the draft only when `want_draft` and one is named
    (`auto`: the best compatible draft on disk, or none). `n_seq_max`: parallel
    sequences in the target's context and the draft's (serving: one per slot)."""
    target_path = models.resolve(opts.model, role="target")
    opts = with_model_context(opts, target_path)  # -c 0: the target's, for the draft too
    draft_spec = (opts.draft or "none") if want_draft else "none"
    draft_path = None  # resolved before any load: a bad name fails fast
    if draft_spec.lower() not in ("none", "auto"):
        draft_path = models.resolve(draft_spec, role="draft")
    target = load_model(opts, "target", target_path, n_seq_max=n_seq_max)
    try:
        if opts.flash_attn == "auto":  # what tune measured faster on this machine, if it did
            tuned = find_profile(target)
            if tuned is not None and tuned.flash_attn:
                target.set_flash_attn(tuned.flash_attn)
        draft = None
        if draft_spec.lower() == "auto":
            draft = _auto_draft(target, opts, n_seq_max)
        elif draft_path is not None:
            draft = load_model(opts, "draft", draft_path, n_seq_max=n_seq_max)
            _check_pair(target, draft)
    except BaseException:
        target.close()
        raise
    return Runtime(target, draft)


def load_model(opts: LoadOptions, role: str, path: str | Path | None = None, *,
               n_seq_max: int = 1) -> Model:
    """Load one model, the target or the draft (`role`: which name in `opts` to resolve
    when no `path` is given, and which GPU layers), with the context and threads of
    `opts`; no pair check."""
    path = path or models.resolve(opts.model if role == "target" else opts.draft, role=role)
    return Model(model_config(with_model_context(opts, path), path, role, n_seq_max))


def with_model_context(opts: LoadOptions, path: str | Path) -> LoadOptions:
    """`-c 0` (as in llama.cpp): the context the model was trained with, from its GGUF
    header; other sizes as given."""
    if opts.n_ctx != 0:
        return opts
    try:
        n_ctx = read_info(path).context_length
    except (GGUFError, OSError) as exc:
        raise UsageError(f"-c 0: cannot read the context length of {path}: {exc}; give -c N") from None
    if n_ctx <= 0:
        raise UsageError(f"-c 0: {Path(path).name} does not say its context length; give -c N")
    return replace(opts, n_ctx=n_ctx)


def model_config(opts: LoadOptions, path: object, role: str, n_seq_max: int = 1) -> ModelConfig:
    """How to load the target or the draft. The draft joins the --rpc workers only when
    -ngld puts a positive number of layers there: by default it stays on this machine,
    where drafting costs no round trips. --tensor-split is the target's."""
    draft = role == "draft"
    ngl = opts.n_gpu_layers_draft if draft else opts.n_gpu_layers
    return ModelConfig(
        path=str(path), n_ctx=opts.n_ctx, n_threads=opts.n_threads, n_gpu_layers=ngl,
        n_seq_max=n_seq_max, verbose=opts.verbose,
        rpc=opts.rpc if not draft or ngl > 0 else (), tensor_split=() if draft else opts.tensor_split,
        flash_attn="auto" if draft else opts.flash_attn,
    )


def setup_of(target: Model, draft: Model | None = None) -> Setup:
    """The calibration setup of loaded models: what their profile is keyed by."""
    device = "gpu" if supports_gpu_offload() and target.info.n_gpu_layers else "cpu"
    return Setup(model_id(target.path), model_id(draft.path) if draft else None, device,
                 target.info.n_threads, target.info.n_gpu_layers, tuple(target.info.rpc),
                 target.cfg.flash_attn)


def find_profile(target: Model, draft: Model | None = None, online: bool = False) -> Profile | None:
    """The calibration profile (`localspec tune`) of these loaded models, if stored
    (`online`: also one that holds only what runs measured: `--spec auto`'s costs,
    `bench --serve`'s load limits)."""
    return load_profile(setup_of(target, draft), online=online)


def _check_pair(target: Model, draft: Model) -> None:
    """check_pair, closing the draft when it refuses."""
    try:
        check_pair(target, draft)
    except BaseException:
        draft.close()
        raise


def _auto_draft(target: Model, opts: LoadOptions, n_seq_max: int = 1) -> Model | None:
    """The best draft on disk by its header (models/drafts.py) that check_pair accepts
    once loaded; None (n-gram drafting) when there is none. Says which on stderr."""
    try:
        kept = [c for c in draft_candidates(target.path) if c.kept]
    except (GGUFError, OSError) as exc:
        _notice(f"draft: none (auto: cannot read the target's GGUF header: {exc}); drafting with n-grams")
        return None
    for cand in kept[:AUTO_DRAFT_TRIES]:
        try:
            draft = load_model(opts, "draft", cand.path, n_seq_max=n_seq_max)
        except LocalspecError as exc:
            _notice(f"draft auto: skipped {cand.name}: {exc}")
            continue
        try:
            _check_pair(target, draft)
        except IncompatibleModels as exc:
            _notice(f"draft auto: skipped {cand.name}: {exc}")
            continue
        _notice(f"draft: {cand.name} (auto: {cand.reason})")
        return draft
    _notice("draft: none (auto: no compatible smaller model on disk, see `localspec models "
            "--drafts-for`); drafting with n-grams")
    return None


def _notice(message: str) -> None:
    print(message, file=sys.stderr)


class EditPrediction(NamedTuple):
    """An edit's file as its instruction foretells it, in the target's tokens: the
    prediction (`tokens`), the old names it kept (`old`), and the tokens before which a
    foretold change of unknown text goes in (`unsure`: positions in `tokens`)."""

    tokens: list[int]
    old: tuple[str, ...]
    unsure: tuple[int, ...]


def predict_edit(target: Model, extra: Sequence[int], instruction: str,
                 filename: str | None) -> EditPrediction | None:
    """The file `extra` (its tokens) as an edit's `instruction` foretells it: its
    replacements, renames and settings made (renames.py, settings.py), and the sites of
    its type hints and docstrings (sites.py); None where it foretells nothing."""
    if not instruction or not extra:
        return None
    renaming = renames.predict(target.detokenize(extra), instruction, filename)
    if renaming is None:
        return None
    tokens = target.tokenize(renaming.text, add_special=False, parse_special=False)
    unsure = (sites.at_tokens([target.token_piece(t) for t in tokens], renaming.text, renaming.sites)
              if renaming.sites else [])
    return EditPrediction(tokens, renaming.old, tuple(unsure))


def make_drafter(
    spec: SpecConfig,
    sampling: SamplingConfig,
    draft_model: Model | None,
    extra: Sequence[int] = (),
    target: Model | None = None,
    *,
    seq: int = 0,
    batch: DraftBatch | None = None,
    memory: Memory | None = None,
    remember: bool = True,
    learned: Learned | None = None,
    costs: Profile | None = None,
    instruction: str = "",
    filename: str | None = None,
) -> Drafter:
    """The drafter for `spec.mode`; `extra` is a second n-gram source (a file's tokens).
    `auto` uses the calibration profile of `target` (and the draft) when one exists,
    and stores the verify costs each generation measured into it. The model drafter
    drafts on the draft's sequence `seq`; with `batch` (the server's slots) its drafts
    are made together with the other slots' when the batch runs. `memory` (auto only):
    earlier outputs to draft from; `remember`: whether this output joins it; `learned`
    (auto only): the verify costs and copy acceptance earlier generations measured, kept
    for later ones (the server's requests); `costs` (auto only): verify costs taken as
    given, neither timed nor stored, in place of the profile (tests whose drafting must
    not hang on this machine's load while they run); `instruction` and `filename`: an
    edit's, whose foretold changes the n-gram drafter copies ahead (predict_edit)."""
    if spec.mode is SpecMode.NONE:
        return NoDrafter()
    # the tokens' texts let a copy followed across a rename stop before its other spellings
    text = ((lambda t: target.token_piece(t).decode("utf-8", errors="replace"))
            if extra and target is not None and hasattr(target, "token_piece") else None)
    renaming = predict_edit(target, extra, instruction, filename) if text is not None else None
    ngram = NgramDrafter(spec.ngram_min, spec.ngram_max, extra, text=text,
                         prediction=renaming.tokens if renaming else None,
                         renamed=renaming.old if renaming else (), unsure=renaming.unsure if renaming else ())
    if spec.mode is SpecMode.NGRAM:
        return ngram
    model = (ModelDrafter(draft_model, sampling, spec.draft_p_min, seq=seq, batch=batch)
             if draft_model else None)
    if spec.mode is SpecMode.AUTO:
        # the verify costs: given (`costs`, neither timed nor stored), else the target's
        # profile, timed on-line and stored back at each generation's end
        setup = setup_of(target, draft_model) if costs is None and target is not None else None
        profile = load_profile(setup, online=True) if setup is not None else costs
        recall = (MemoryDrafter(memory, learn=remember,
                                model=MemoryModel(profile.memory_accept if profile else None))
                  if memory is not None else None)
        store = None
        if setup is not None:
            def store(measured: dict[int, tuple[float, int]], t1: float) -> None:
                store_online_later(setup, target.name, measured, t1,
                                   memory=recall.model.to_dict() if recall is not None else None)

        return AutoDrafter(ngram, model, profile, k_max=max(1, spec.draft_max), learn_costs=costs is None,
                           store=store, memory=recall, learned=learned)
    if model is None:
        raise UsageError(f"--spec {spec.mode} needs a draft model (--draft)")
    return model if spec.mode is SpecMode.MODEL else HybridDrafter(ngram, model)


def log_run(command: str, stats: GenerationStats | None, target: Model, draft: Model | None,
            spec: SpecConfig, sampling: SamplingConfig, *, tag: str | None = None,
            prompt_text: str = "", output_text: str = "", enabled: bool = True) -> None:
    """Record one generation of `command` in the acceptance log, if it ended (`stats`;
    None: cut short before Done); `draft`: the draft model it was given. The texts
    choose the workload tag when `tag` is None. Never raises: the log must not break a
    run."""
    if stats is None:
        return
    logdb.log_generation(
        command, stats, target=target.path, draft=draft.path if draft else None, spec=spec,
        sampling=sampling, tag=tag, prompt_text=prompt_text, output_text=output_text,
        enabled=enabled,
    )

