"""Drafters: cheap proposals that the target verifies in one batch."""

from localspec.drafters.base import Draft, Drafter, NoDrafter
from localspec.drafters.hybrid import HybridDrafter
from localspec.drafters.ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "NoDrafter", "NgramDrafter", "HybridDrafter"]
