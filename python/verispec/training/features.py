"""What the frozen target says about each training token, computed once and kept on disk.

For every token of every sequence the store holds (shards of .npy files, read back
memory-mapped, so epochs and resumed runs never run the target again):

    tokens    int32   [n]          the sequence's ids
    taps      float16 [n, k*H_t]   the target's states at the head's tap layers (the
                                   residual stream entering layer i, Feature.layer_input;
                                   the last layer's output for i = num_layers)
    top_ids   int32   [n, K]       the K most likely draft ids of the target's next-token
    top_logp  float16 [n, K]       distribution restricted to the draft vocabulary
                                   (log-probs renormalized over it); K = the whole draft
                                   vocabulary when top_k is 0
    greedy    int32   [n]          the target's argmax over its full vocabulary

Position p's distribution is the target's prediction of token p + 1. Soft targets over
the draft vocabulary are what the head can match (q is 0 outside it); K = 32 keeps
nearly all of a chat model's mass at 200 bytes a token instead of 2 bytes per draft id.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["FeatureStore", "extract_features", "tap_keys"]

Progress = Optional[Callable[[int, int, str], None]]
_FILES = ("tokens", "taps", "top_ids", "top_logp", "greedy")


def tap_keys(taps: Sequence[int], num_layers: int) -> list[int]:
    """The feature-pool keys (Feature.key) of tap layers "entering layer i"."""
    from verispec.drafters.base import Feature

    return [(Feature.final() if t == num_layers else Feature.layer_input(t)).key(num_layers)
            for t in taps]


@dataclass(frozen=True)
class _Seq:
    shard: int
    offset: int
    length: int


class FeatureStore:
    """A folder of feature shards (module doc); ``open`` reads one, ``sequence(i)`` gives
    sequence i's arrays as torch tensors (float16 kept)."""

    def __init__(self, folder: str, meta: dict) -> None:
        self.folder, self.meta = folder, meta
        self.seqs = [_Seq(*s) for s in meta["sequences"]]
        self._shards: dict[int, dict[str, np.ndarray]] = {}

    @staticmethod
    def is_complete(folder: str, fingerprint: str) -> bool:
        path = os.path.join(folder, "meta.json")
        if not os.path.isfile(path):
            return False
        with open(path) as f:
            meta = json.load(f)
        return bool(meta.get("complete")) and meta.get("fingerprint") == fingerprint

    @classmethod
    def open(cls, folder: str) -> "FeatureStore":
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
        if not meta.get("complete"):
            raise ValueError(f"FeatureStore.open: {folder} is incomplete (its extraction "
                             f"was interrupted); extract again")
        return cls(folder, meta)

    def __len__(self) -> int:
        return len(self.seqs)

    def _shard(self, j: int) -> dict[str, np.ndarray]:
        if j not in self._shards:
            base = os.path.join(self.folder, f"shard_{j:05d}")
            self._shards[j] = {name: np.load(os.path.join(base, f"{name}.npy"), mmap_mode="r")
                               for name in _FILES}
        return self._shards[j]

    def length(self, i: int) -> int:
        return self.seqs[i].length

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        s = self.seqs[i]
        arrays = self._shard(s.shard)
        sl = slice(s.offset, s.offset + s.length)
        out = {name: torch.from_numpy(np.array(arrays[name][sl])) for name in _FILES}
        out["tokens"] = out["tokens"].long()
        out["top_ids"] = out["top_ids"].long()
        out["greedy"] = out["greedy"].long()
        return out


class _ShardWriter:
    def __init__(self, folder: str, index: int, tokens: int, width: int, k: int) -> None:
        from numpy.lib.format import open_memmap

        self.base = os.path.join(folder, f"shard_{index:05d}")
        os.makedirs(self.base, exist_ok=True)
        shapes = {"tokens": ((tokens,), np.int32), "taps": ((tokens, width), np.float16),
                  "top_ids": ((tokens, k), np.int32), "top_logp": ((tokens, k), np.float16),
                  "greedy": ((tokens,), np.int32)}
        self.arrays = {name: open_memmap(os.path.join(self.base, f"{name}.npy"), mode="w+",
                                         dtype=dtype, shape=shape)
                       for name, (shape, dtype) in shapes.items()}
        self.used = 0

    def write(self, values: dict[str, torch.Tensor]) -> int:
        n = values["tokens"].shape[0]
        for name, array in self.arrays.items():
            array[self.used:self.used + n] = values[name].numpy()
        offset, self.used = self.used, self.used + n
        return offset

    def close(self) -> None:
        for array in self.arrays.values():
            array.flush()
        self.arrays.clear()


def extract_features(target: Any, sequences: Sequence[Sequence[int]], folder: str, *,
                     taps: Sequence[int], draft_ids: torch.Tensor, top_k: int = 32,
                     batch_tokens: int = 2048, shard_tokens: int = 32768,
                     fingerprint: str = "", progress: Progress = None) -> FeatureStore:
    """Run the frozen target over ``sequences`` (several per pass, up to ``batch_tokens``
    tokens) and write the store into ``folder`` (module doc). ``draft_ids``: the draft
    vocabulary's target ids (int64 [V_draft]); ``top_k`` 0 keeps all of it."""
    from verispec.cache import blocks_for
    from verispec.models.testing import PagedRunner

    g = target.geometry
    keys = tap_keys(taps, g.num_layers)
    k = int(draft_ids.numel()) if top_k == 0 else min(top_k, int(draft_ids.numel()))
    width = len(keys) * int(g.hidden_size)
    os.makedirs(folder, exist_ok=True)
    meta_path = os.path.join(folder, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)
    lengths = [len(s) for s in sequences]
    if not lengths or min(lengths) < 2:
        raise ValueError(f"extract_features: every sequence needs >= 2 tokens, got lengths "
                         f"as short as {min(lengths) if lengths else 'none (no sequences)'}")
    # passes of whole sequences, in order
    passes: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if passes[-1] and used + n > batch_tokens:
            passes.append([])
            used = 0
        passes[-1].append(i)
        used += n
    bs = 16
    biggest = max(sum(blocks_for(lengths[i], bs) for i in p) for p in passes)
    runner = PagedRunner(target, num_blocks=biggest + 1, block_size=bs, features=keys)
    device = torch.device(g.device)
    dids = draft_ids.to(device)
    index: list[tuple[int, int, int]] = []
    shard = None
    shard_no = -1
    done_tokens, total_tokens = 0, sum(lengths)
    with torch.inference_mode():
        for p in passes:
            seqs = [runner.add_sequence() for _ in p]
            logits = runner.step({s: list(sequences[i]) for s, i in zip(seqs, p)})
            for s, i, row_logits in zip(seqs, p, logits):
                n = lengths[i]
                feats = torch.cat([runner.features_of(s, key) for key in keys], dim=-1)
                full = row_logits.float()
                logp = torch.log_softmax(full[:, dids], dim=-1)
                top = torch.topk(logp, k, dim=-1, sorted=True)
                values = {"tokens": torch.tensor(sequences[i], dtype=torch.int32),
                          "taps": feats.to("cpu", torch.float16),
                          "top_ids": top.indices.to("cpu", torch.int32),
                          "top_logp": top.values.to("cpu", torch.float16),
                          "greedy": full.argmax(-1).to("cpu", torch.int32)}
                if shard is None or shard.used + n > shard_tokens:
                    if shard is not None:
                        shard.close()
                    shard_no += 1
                    remaining = sum(lengths[j] for j in range(i, len(lengths)))
                    shard = _ShardWriter(folder, shard_no, max(n, min(shard_tokens, remaining)),
                                         width, k)
                index.append((shard_no, shard.write(values), n))
                done_tokens += n
            for s in seqs:
                runner.free(s)
            if progress is not None:
                progress(done_tokens, total_tokens, "target features")
    if shard is not None:
        shard.close()
    meta = {"complete": True, "fingerprint": fingerprint, "taps": list(taps),
            "tap_keys": keys, "hidden_size": int(g.hidden_size), "top_k": k,
            "draft_size": int(draft_ids.numel()), "num_tokens": total_tokens,
            "sequences": index}
    tmp = meta_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, meta_path)
    return FeatureStore(folder, meta)
