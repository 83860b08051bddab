"""EAGLE-3 drafting: a one-layer head that drafts from the target's own hidden states.

    drafter = Eagle3(target, "path/to/head")     # EAGLE/SpecForge or speculators layout
    dec = SpecDecoder(target, drafter)

The head (``eagle3_head.Eagle3Head``) reads the target's residual stream at its tap
layers for the token before each input (the target writes them at its slots:
``Feature``, ``KVPools.features``). Its draft passes run as a draft model with a cache of
its own: one layer of K/V and the head's own output state (fed back for the next draft
position, as the head was trained: step k >= 1 reads the previous step's output).

Which state a token reads: the target's when the target has processed the position
before it (every committed token: the core lets a row draft only once the target has
cached all but its last committed token, and after each step keeps only the head's
catch-up in its cache, so accepted proposals are redone from the target's states,
``DecoderConfig::draft_reads_target``), the head's own otherwise (the proposals of this
step). The first token of a sequence has no predecessor: its state is zero.

The head proposes over its draft vocabulary; its logits are returned over the target's
vocabulary with -inf outside it, so q is exactly the distribution each proposal was
drawn from (q = 0 where the head cannot propose) and verification stays exact.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch

from verispec.drafters.base import DraftSpec, Feature
from verispec.drafters.eagle3_head import Eagle3Head, TargetShape

__all__ = ["Eagle3", "Eagle3Model", "default_head_path"]

# The key of the head's own output state in its cache's feature pools.
_OWN = 0


def default_head_path() -> Optional[str]:
    """The head shipped for the bundled SmolLM2-135M-Instruct, or None when this build
    has none."""
    path = os.path.join(os.path.dirname(__file__), "heads", "smollm2-135m-instruct")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def _target_embed(target: Any):
    """The target's token embedding as a function ids [T] -> [T, H] (a quantized table is
    looked up in place), for a head without embed_tokens."""
    embed = getattr(target, "embed", None)
    if callable(embed):
        return embed
    hf = getattr(target, "model", None)
    if hf is not None and hasattr(hf, "get_input_embeddings"):
        return hf.get_input_embeddings()
    raise ValueError(f"Eagle3: the head has no embed_tokens and {type(target).__name__} "
                     f"offers no embedding (an embed(ids) method or a transformers model)")


def _tap_feature(layer: int, num_layers: int) -> Feature:
    """A head's tap (the stream entering target layer ``layer``; num_layers: the last
    layer's output) as a Feature."""
    return Feature.final() if layer == num_layers else Feature.layer_input(layer)


class Eagle3Model:
    """The head's draft passes over a PagedBatch (the Model protocol): its own one-layer
    KV pool and own-state pool, the target's states through ``batch.target_features``."""

    def __init__(self, head: Eagle3Head, taps: tuple[int, ...], target_geometry: Any):
        from verispec.models.base import ModelGeometry

        cfg = head.config
        self.head, self.taps = head, tuple(taps)
        self.features = tuple(_tap_feature(t, target_geometry.num_layers) for t in taps)
        self.vocab_size = target_geometry.vocab_size
        self.geometry = ModelGeometry(
            num_layers=1, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            vocab_size=target_geometry.vocab_size, max_context=target_geometry.max_context,
            dtype=head.dtype, device=torch.device(head.device), hidden_size=cfg.hidden_size)
        self.scaling = 1.0 / math.sqrt(cfg.head_dim)

    def __call__(self, batch: Any) -> torch.Tensor:
        return self.forward(batch)

    @torch.inference_mode()
    def forward(self, batch: Any) -> torch.Tensor:
        """Logits [R, V] (the target's vocabulary; -inf outside the head's) of the tokens
        ``batch.logits_indices``."""
        from verispec.models.base import check_batch
        from verispec.models.layers.attention import TorchAttention
        from verispec.models.layers.paged import PagedPlan

        check_batch(batch, self.geometry, "Eagle3Model.forward")
        view = batch.target_features
        if view is None:
            raise ValueError("Eagle3Model.forward: the batch carries no target_features "
                             "(a draft pass of SpecDecoder with the Eagle3 drafter does)")
        head, device = self.head, self.geometry.device
        ids = batch.input_ids.to(device)
        positions = batch.positions.to(device=device, dtype=torch.long)
        starts = batch.host_tensor("query_start")
        counts = (starts[1:] - starts[:-1]).tolist()
        rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(device)
        prev = positions - 1
        # the target's states of the previous position where it processed it, else the
        # head's own (its last pass's output at that position), zero before position 0
        from_target = (prev >= 0) & (prev < view.cached.to(device)[rows])
        at = prev.clamp(min=0)
        taps = torch.cat([view.read(f, rows, at) for f in self.features], dim=-1)
        g_target = head.fuse_taps(taps.to(head.dtype))
        own_pool = batch.kv.features[_OWN]
        bs = own_pool.shape[1]
        tables = batch.block_tables.to(device).long()
        own_slots = tables[rows, at // bs] * bs + at % bs
        own = own_pool.view(-1, own_pool.shape[-1]).index_select(0, own_slots.clamp(min=0))
        g = torch.where(from_target[:, None], g_target, own)
        g = torch.where((prev >= 0)[:, None], g, torch.zeros_like(g))

        plan = PagedPlan(batch, device, who="Eagle3Model.forward")
        plan.groups  # noqa: B018 - built (and checked) before any write
        attention = TorchAttention(sdpa_groups=True)
        cfg = head.config
        k_flat = batch.kv.k[0].view(-1, cfg.num_key_value_heads, cfg.head_dim)
        v_flat = batch.kv.v[0].view(-1, cfg.num_key_value_heads, cfg.head_dim)

        def attend(q, k, v):
            plan.write(k_flat, k)
            plan.write(v_flat, v)
            return attention.attend(plan, q, k_flat, v_flat, scaling=self.scaling)

        logits, hidden_out = head.forward(ids, positions, hidden=g, attention=attend)
        batch.kv.write_features(plan.write, _OWN, hidden_out)
        return head.scatter_to_target(logits[batch.logits_indices.to(device)])


class Eagle3:
    """EAGLE-3 drafting (module doc): the head in folder ``path`` (the EAGLE/SpecForge
    layout or the speculators one; None: the head shipped for the bundled model), read
    in the target's dtype on its device. Refused (ValueError naming the field and both
    values) when the head does not fit the target: hidden size, vocabulary, a tap past
    the last layer.

    ``weights``: "auto" (Q8_0 for a float32 CPU head whose rows are whole blocks of 32,
    else the head's dtype), "Q8_0" (the matrices, lm_head included, in verispec's native
    int8 kernels: about a quarter of float32's bytes, the pass's cost) or "float32"."""

    def __init__(self, target: Any, path: Optional[str | os.PathLike] = None, *,
                 weights: str = "auto") -> None:
        g = target.geometry
        if weights not in ("auto", "Q8_0", "float32"):
            raise ValueError(f"Eagle3: weights must be 'auto', 'Q8_0' or 'float32', got "
                             f"{weights!r}")
        if path is None:
            path = default_head_path()
            if path is None:
                raise ValueError("Eagle3: path is None and this build ships no head; pass "
                                 "the folder of an EAGLE-3 head (or train one: verispec "
                                 "train-head --model M --out DIR)")
        if g.hidden_size is None or not getattr(target, "writes_features", False):
            raise ValueError(f"Eagle3: the target must write its hidden states for the head "
                             f"(a verispec LlamaModel or HFModel), got {type(target).__name__}")
        head = Eagle3Head.load(path, dtype=g.dtype, device=g.device)
        taps = head.check_target(TargetShape(hidden_size=g.hidden_size,
                                             vocab_size=g.vocab_size, num_layers=g.num_layers))
        if not head.config.own_embedding:
            if head.config.hidden_size != g.hidden_size:
                raise ValueError(f"Eagle3: a head without embed_tokens reads the target's "
                                 f"embedding, so its hidden_size must be the target's "
                                 f"{g.hidden_size}, got {head.config.hidden_size}")
            head.bind_target_embedding(_target_embed(target))
        on_cpu = head.device.type == "cpu" and head.dtype == torch.float32
        fmt = ("Q8_0" if on_cpu else "float32") if weights == "auto" else weights
        #: the head's matrices: {"format", "bytes", "float32_bytes"} (Eagle3Head.use_native_weights)
        self.weights = {"format": str(head.dtype).replace("torch.", ""), "bytes": None,
                        "float32_bytes": None}
        if fmt == "Q8_0":
            try:
                self.weights = head.use_native_weights("Q8_0")
            except ValueError:
                if weights != "auto":   # asked for; "auto" keeps a head Q8_0 cannot hold
                    raise
        self.path = os.fspath(path)
        self.head = head
        self.taps = taps
        self.model = Eagle3Model(head, taps, g)
        self.tokenizer_fingerprint = getattr(target, "tokenizer_fingerprint", None)

    @property
    def geometry(self):
        return self.model.geometry

    def spec(self, target: Any) -> DraftSpec:
        cfg = self.head.config
        vocab = self.head.target_ids.cpu() if cfg.draft_vocab_size < cfg.vocab_size else None
        if vocab is not None:
            vocab = torch.sort(vocab).values
        return DraftSpec(kind="model", model=self.model, cache="own",
                         features=self.model.features, own_features=(_OWN,),
                         draft_vocab=vocab)

    def describe(self) -> dict:
        """What ``verispec info`` shows: the folder, taps, draft vocabulary, sizes."""
        cfg = self.head.config
        return {"path": self.path, "taps": list(self.taps),
                "draft_vocab_size": cfg.draft_vocab_size, "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size, "layer_type": cfg.layer_type,
                "weights": self.weights["format"],
                "parameters": sum(t.numel() for t in self.head.weights.values())}
