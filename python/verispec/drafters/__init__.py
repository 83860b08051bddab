"""Draft sources for SpecDecoder.

- ``NGram(min_n, max_n)``: prompt lookup in the sequence's own tokens (native,
  incremental index). Proposals are deterministic, so verification uses the one-hot
  rule and the output stays exact. ``NGram(memory=NGramMemory())`` also copies from a
  tenant's earlier requests and answers.
- ``EarlyExit(target, num_layers=N)``: self-speculation, the target's first N layers
  plus its final norm and head, sharing the target's weights (no copy).
- ``Eagle3(target, path)``: an EAGLE-3 head drafting from the target's hidden states
  (either shared checkpoint layout; drafters/eagle3.py).
- Any model implementing the protocol (verispec.models.base.Model): a separate draft
  (``DraftModel(model)``; SpecDecoder wraps a model given as draft).

A drafter implements ``verispec.drafters.Drafter``: ``spec(target) -> DraftSpec`` says
what it needs (drafters/base.py); a new drafter is one new file here.
"""

from verispec.drafters.base import (DraftModel, Drafter, DraftSpec, Feature, FeatureView,
                                    as_drafter)
from verispec.drafters.eagle3 import Eagle3
from verispec.drafters.early_exit import EarlyExit
from verispec.drafters.ngram import NGram, NGramMemory

__all__ = ["DraftModel", "DraftSpec", "Drafter", "Eagle3", "EarlyExit", "Feature", "FeatureView",
           "NGram", "NGramMemory", "as_drafter"]
