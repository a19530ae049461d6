"""Drafters: cheap proposals that the target verifies in one batch."""

from localspec.core.drafters.base import Draft, Drafter, NoDrafter
from localspec.core.drafters.hybrid import HybridDrafter
from localspec.core.drafters.ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "NoDrafter", "NgramDrafter", "HybridDrafter"]
