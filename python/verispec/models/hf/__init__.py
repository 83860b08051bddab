"""HFModel: any transformers causal LM as a verispec model (``hf.model``), beside the
native Llama on the shared model layers (``verispec.models.layers``).

- ``model``: HFModel itself (construction, probe, forward, early exit, tensor parallel);
- ``attention``: the attention function transformers calls per layer, the probe and a
  forward's plan (``ATTN_IMPLEMENTATION``, ``register_attention``);
- ``patch``: the module patching (verispec's CPU kernels, the batch-invariant mode);
- ``capture``: decode and verify forwards recorded once and replayed as programs;
- ``features``: the taps that write the hidden states a drafter reads
  (``KVPools.features``) from the model's decoder layers and final norm;
- ``tp``: tensor parallelism along the config's ``base_model_tp_plan``.

(``models/hf_folder.py``, which reads a Hugging Face folder for the native Llama, is a
loader: it builds a LlamaConfig, so it lives with the loaders, not here.)
"""

from verispec.models.hf.attention import ATTN_IMPLEMENTATION, register_attention
from verispec.models.hf.model import HFModel

__all__ = ["ATTN_IMPLEMENTATION", "HFModel", "register_attention"]
