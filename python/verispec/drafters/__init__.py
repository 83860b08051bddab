"""Draft sources for SpecDecoder.

- ``NGram(min_n, max_n)``: prompt lookup in the sequence's own tokens (native,
  incremental index). Proposals are deterministic, so verification uses the one-hot
  rule and the output stays exact.
- ``EarlyExit(target, num_layers=N)``: self-speculation, the target's first N layers
  plus its final norm and head, sharing the target's weights (no copy).
- Any model implementing the protocol (verispec.models.base.Model): a separate draft.
"""

from verispec.drafters.early_exit import EarlyExit
from verispec.drafters.ngram import NGram

__all__ = ["EarlyExit", "NGram"]
