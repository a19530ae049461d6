"""Configuration as frozen dataclasses; no I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from localspec.core.tuning import DRAFT_MAX, DRAFT_P_MIN


class StrEnum(str, Enum):
    """A str-valued enum: it compares, hashes, formats and serialises (JSON, SQLite, log
    lines) as its value, so what goes on the wire and into logs stays the plain string.
    (enum.StrEnum is 3.11+; the package supports 3.10.)"""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class SpecMode(StrEnum):
    """Which drafter a generation speculates with (--spec)."""

    AUTO = "auto"  # a cost-model policy chooses n-gram, the draft model or nothing, and k
    NONE = "none"  # plain decoding
    NGRAM = "ngram"  # prompt lookup
    MODEL = "model"  # the draft model
    HYBRID = "hybrid"  # n-gram when the context has a match, else the draft model

    @property
    def drafts(self) -> bool:
        """Whether a round may verify a draft at all."""
        return self is not SpecMode.NONE

    @property
    def uses_draft_model(self) -> bool:
        """Whether a loaded draft model is used (auto: when it pays)."""
        return self in (SpecMode.AUTO, SpecMode.MODEL, SpecMode.HYBRID)

    @property
    def uses_ngram(self) -> bool:
        """Whether n-gram (prompt lookup) drafts may be proposed."""
        return self in (SpecMode.AUTO, SpecMode.NGRAM, SpecMode.HYBRID)

    @property
    def uses_memory(self) -> bool:
        """Whether earlier outputs (the memory, --lookup corpora) are a draft source."""
        return self is SpecMode.AUTO

    @property
    def needs_draft_model(self) -> bool:
        """Whether this mode cannot run without a draft model."""
        return self in (SpecMode.MODEL, SpecMode.HYBRID)

    @property
    def chooses_k(self) -> bool:
        """Whether the drafter chooses k itself each round (auto's policy), so AdaptiveK
        stays out of it."""
        return self is SpecMode.AUTO


SPEC_MODES = tuple(m.value for m in SpecMode)  # the --spec choices, as typed


@dataclass(frozen=True)
class ModelConfig:
    """How to load one GGUF."""

    path: str
    n_ctx: int = 4096
    n_threads: int | None = None  # None: llama.cpp's default for this machine
    n_gpu_layers: int = -1  # -1: all layers when the build can offload, else 0
    n_seq_max: int = 1
    verbose: bool = False
    rpc: tuple[str, ...] = ()  # ggml RPC workers (HOST:PORT) whose devices take offloaded layers
    tensor_split: tuple[float, ...] = ()  # share of offloaded layers per device (workers first)
    flash_attn: str = "auto"  # on, off, or auto: llama.cpp's choice (runtime may apply tune's)


@dataclass(frozen=True)
class LoadOptions:
    """Which target (and draft) to load and how: the shared command-line options
    (commands/options.py builds it; runtime.py loads from it). Model names are
    paths, manifest names or org/repo[:file.gguf]; None: the manifest's default."""

    model: str | None
    draft: str | None
    n_ctx: int
    n_threads: int | None
    n_gpu_layers: int
    n_gpu_layers_draft: int
    verbose: bool = False
    rpc: tuple[str, ...] = ()  # --rpc HOST:PORT workers, whose devices take layers
    tensor_split: tuple[float, ...] = ()  # --tensor-split: the target's share per device
    flash_attn: str = "auto"  # -fa: on, off, or auto (what `localspec tune` measured faster)


@dataclass(frozen=True)
class SamplingConfig:
    """Applied identically to target (p) and draft (q) distributions."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class SpecConfig:
    """Which drafter and how many tokens to draft per round."""

    mode: SpecMode = SpecMode.NGRAM  # a plain string is taken as the mode it names
    draft_max: int = DRAFT_MAX
    draft_min: int = 0
    draft_p_min: float = DRAFT_P_MIN  # model drafter stops when its top prob falls below
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive: bool = True  # k may adapt (not --fixed-k); whether it does: adapts_k

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", SpecMode(self.mode))  # ValueError for an unknown one

    @property
    def adapts_k(self) -> bool:
        """Whether AdaptiveK grows k after fully accepted rounds and shrinks it after
        early misses: asked for, and the drafter does not choose k itself (auto)."""
        return self.adaptive and not self.mode.chooses_k


@dataclass(frozen=True)
class GenerationConfig:
    """When to stop, what to report per token, and what the output may be."""

    max_tokens: int = 512  # -n; <= 0 means until EOS or context full
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # each Token's logprob with this many alternatives; None: off
    # GBNF (root rule `root`) every generated token must follow: --grammar, --json-schema,
    # response_format; the engine compiles it with llama.cpp's grammar sampler
    grammar: str | None = None
    # code completion (llama-server's /infill; core/limits.py): a later line indented
    # less than n_indent ends the output, and so does the first line end after
    # t_max_predict_ms of generation (0: off)
    n_indent: int = 0
    t_max_predict_ms: float = 0
