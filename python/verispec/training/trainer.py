"""Training an EAGLE-3 head on the frozen target's features: the head, its loss, the loop.

The head is ``Eagle3Head`` itself: its tensors are ``nn.Parameter``s (``HeadParameters``
registers them), so the one forward that drafts is the one that trains, and what is
saved is ``Eagle3Head.save``'s speculators layout. The embedding is the target's,
frozen and not written (readers bind the target's, as for published heads).

Initialization: lm_head = the target's lm_head rows of the draft vocabulary; the layer
and fc random (normal, std 1/sqrt(fan_in), from the seed); every norm 1. (The target's
final norm as the head's norm starts SmolLM2-135M's head at about twice the loss and
lower held-out acceptance after 12 steps: its weights sharpen logits of a state that is
still random.)

Loss: the training-time-test unroll of ``Eagle3Head.unroll`` over S steps (step s, row
t: the token at t + s with the head's own state from step s - 1, predicting token
t + s + 1), each step weighted ``step_weight ** s``, cross-entropy against the target's
distribution at position t + s over the draft vocabulary (soft; the stored top-K
renormalized), mixed with the hard label (the data's next token, where the draft
vocabulary holds it) by ``hard_weight``. Rows count where the token they predict is an
answer token. Held-out acceptance: per step, how often the head's greedy draft equals
the target's greedy next token on held-out sequences (teacher-forced chains).

Order and resumption: epoch e visits the training sequences in the permutation of
seed (seed, e), cut into optimizer steps of about ``batch_tokens`` tokens (gradients
accumulated, normalized by the step's counted rows). A checkpoint holds the
parameters, AdamW's state, the position (epoch, batch) and the RNG state; the schedule
is a function of the step. Resuming from one gives, on the CPU with the same threads,
the bit-identical weights of an uninterrupted run.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from verispec.drafters.eagle3_head import Eagle3Config, Eagle3Head, expected_shapes
from verispec.training.features import FeatureStore
from verispec.training.options import TrainConfig
from verispec.training.vocab import DraftVocab

__all__ = ["HeadParameters", "Trainer", "default_taps", "evaluate",
           "head_config", "init_head", "target_tensors"]

Progress = Optional[Callable[[int, int, str], None]]


# --- the head ---------------------------------------------------------------------------


def default_taps(num_layers: int) -> tuple[int, ...]:
    """The engines' taps (2, N // 2, N - 3), entering those layers; three spread over a
    target of fewer than 7 layers (the last layer's output included)."""
    n = num_layers
    if n >= 7:
        return (2, n // 2, n - 3)
    if n >= 2:
        return tuple(sorted({1, (n + 1) // 2, n})) if n >= 3 else (0, 1, 2)
    return (0, 1)


def _text_config(target: Any) -> Any:
    cfg = getattr(target, "config", None)
    if cfg is not None and hasattr(cfg, "intermediate_size"):
        return cfg                                  # LlamaModel's LlamaConfig
    hf = getattr(target, "model", None)
    hc = getattr(hf, "config", None)
    if hc is not None:
        return hc.get_text_config() if hasattr(hc, "get_text_config") else hc
    return None


def head_config(target: Any, vocab: DraftVocab, taps: Sequence[int]) -> Eagle3Config:
    """A head as wide as the target (its hidden size, heads, MLP width, RoPE base), one
    Llama layer, the draft vocabulary, taps written out."""
    g = target.geometry
    tc = _text_config(target)
    H = int(g.hidden_size)
    heads = int(getattr(tc, "num_attention_heads", 0) or max(1, H // 64))
    kv = int(getattr(tc, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(tc, "head_dim", 0) or H // heads)
    inter = int(getattr(tc, "intermediate_size", 0) or 4 * H)
    theta = getattr(tc, "rope_theta", None)
    if theta is None:
        theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return Eagle3Config(
        hidden_size=H, intermediate_size=inter, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, vocab_size=int(g.vocab_size),
        draft_vocab_size=vocab.size, target_hidden_size=H, tap_layers=tuple(taps),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6) or 1e-6), rope_theta=float(theta),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048) or 2048),
        own_embedding=False)


def _dense(matrix: Any, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    from verispec.models.layers.quantized import QuantizedMatrix

    if isinstance(matrix, QuantizedMatrix):
        return matrix.dequantize(rows)
    m = matrix.detach()
    return (m if rows is None else m[rows.to(m.device)]).float().cpu()


def target_tensors(target: Any, draft_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """float32 CPU copies of the target's embedding [V, H], its lm_head rows of the draft
    vocabulary [V_draft, H] and its final norm [H] (native Llama or transformers)."""
    w = getattr(target, "weights", None)
    if w is not None and hasattr(w, "lm_head"):
        return {"embed": _dense(w.embed), "lm_head": _dense(w.lm_head, draft_ids),
                "norm": _dense(w.final_norm)}
    hf = getattr(target, "model", None)
    if hf is None or not hasattr(hf, "get_input_embeddings"):
        raise ValueError(f"train-head: the target must be a verispec LlamaModel or HFModel, "
                         f"got {type(target).__name__}")
    base = hf.get_decoder() if hasattr(hf, "get_decoder") else getattr(hf, "model", hf)
    norm = getattr(base, "norm", None)
    H = int(target.geometry.hidden_size)
    return {"embed": _dense(hf.get_input_embeddings().weight),
            "lm_head": _dense(hf.get_output_embeddings().weight, draft_ids),
            "norm": (_dense(norm.weight) if norm is not None and hasattr(norm, "weight")
                     else torch.ones(H))}


def init_head(config: Eagle3Config, vocab: DraftVocab, tensors: dict[str, torch.Tensor], *,
              seed: int, device: str | torch.device = "cpu") -> Eagle3Head:
    """The head before training (module doc), float32 on ``device``, the target's
    embedding bound."""
    g = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in sorted(expected_shapes(config).items()):
        if name == "embed_tokens.weight":
            continue
        if name == "lm_head.weight":
            t = tensors["lm_head"].clone()
        elif len(shape) == 1:
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        weights[name] = t.to(device=device, dtype=torch.float32)
    weights["d2t"] = vocab.d2t.to(device)
    weights["t2d"] = vocab.t2d.to(device)
    head = Eagle3Head(config, weights, where="init_head")
    head.bind_target_embedding(tensors["embed"].to(device=device, dtype=torch.float32))
    return head


class HeadParameters(torch.nn.Module):
    """The head's floating tensors as Parameters (its ``weights`` then hold these very
    objects, so ``head.forward`` is differentiable in them)."""

    def __init__(self, head: Eagle3Head) -> None:
        super().__init__()
        self.names = sorted(head.weights)
        self.params = torch.nn.ParameterList()
        for name in self.names:
            p = torch.nn.Parameter(head.weights[name].detach().clone())
            head.weights[name] = p
            self.params.append(p)
        self.head = head

    def named(self) -> dict[str, torch.nn.Parameter]:
        return dict(zip(self.names, self.params))

    def frozen_head(self) -> Eagle3Head:
        """A copy of the head with plain tensors (to save or to draft with)."""
        tensors = {n: p.detach().clone() for n, p in self.named().items()}
        if self.head.d2t is not None:
            tensors["d2t"], tensors["t2d"] = self.head.d2t.clone(), self.head.t2d.clone()
        return Eagle3Head(self.head.config, tensors, where="HeadParameters.frozen_head")


# --- the loss ---------------------------------------------------------------------------


def _inputs(seq: dict, limit: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [n], taps_in [n, k*H]: row t holds the target's states of t - 1,
    zeros for t = 0) of a stored sequence cut to ``limit`` tokens."""
    tokens = seq["tokens"][:limit].to(device)
    taps = seq["taps"][:limit].to(device=device, dtype=torch.float32)
    taps_in = torch.cat([taps.new_zeros(1, taps.shape[1]), taps[:-1]])
    return tokens, taps_in


def _rows(n: int, loss_from: int, step: int) -> torch.Tensor:
    """Rows t of step ``step`` that count: position p = t + step predicts an answer
    token (p >= loss_from - 1) that is in the sequence (p <= n - 2)."""
    t = torch.arange(n)
    p = t + step
    return t[(p >= loss_from - 1) & (p <= n - 2)]


def counted_rows(n: int, loss_from: int) -> int:
    return int(_rows(n, loss_from, 0).numel())


def sequence_loss(head: Eagle3Head, seq: dict, loss_from: int, cfg: TrainConfig,
                  draft_index: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """(the weighted loss summed over counted rows and steps, per-step mean losses)."""
    device = head.device
    tokens, taps_in = _inputs(seq, cfg.max_seq_tokens, device)
    n = tokens.shape[0]
    logits = head.unroll(taps_in, tokens, torch.arange(n, device=device), cfg.ttt_steps)
    total = logits.new_zeros(())
    per_step = []
    for s in range(cfg.ttt_steps):
        rows = _rows(n, loss_from, s).to(device)
        if rows.numel() == 0:
            per_step.append(float("nan"))
            continue
        p = rows + s
        logq = torch.log_softmax(logits[s, rows].float(), dim=-1)
        top_ids = seq["top_ids"][:n].to(device)[p]
        target = torch.softmax(seq["top_logp"][:n].to(device)[p].float(), dim=-1)
        loss = -(target * logq.gather(1, top_ids)).sum(-1)
        if cfg.hard_weight > 0:
            label = draft_index.to(device)[tokens[p + 1]]
            known = label >= 0
            hard = torch.where(known, -logq.gather(1, label.clamp(min=0)[:, None])[:, 0],
                               torch.zeros_like(loss))
            loss = (1 - cfg.hard_weight) * loss + cfg.hard_weight * hard
        total = total + cfg.step_weight ** s * loss.sum()
        per_step.append(float(loss.detach().mean()))
    return total, per_step


@torch.no_grad()
def evaluate(head: Eagle3Head, store: FeatureStore, indices: Sequence[int],
             loss_from: Sequence[int], steps: int, max_seq_tokens: int = 1024) -> dict:
    """Held-out acceptance per unroll step: the fraction of counted rows whose greedy
    draft (mapped to a target id) is the target's greedy next token; and tau, the
    tokens per target pass a chain of ``steps`` would give if each step accepted at
    its rate given the earlier ones: 1 + a0 + a0 a1 + ..."""
    hits = [0] * steps
    counts = [0] * steps
    device = head.device
    for i in indices:
        seq = store.sequence(i)
        tokens, taps_in = _inputs(seq, max_seq_tokens, device)
        n = tokens.shape[0]
        logits = head.unroll(taps_in, tokens, torch.arange(n, device=device), steps)
        greedy = seq["greedy"][:n].to(device)
        for s in range(steps):
            rows = _rows(n, loss_from[i], s).to(device)
            if rows.numel() == 0:
                continue
            draft = head.draft_to_target(logits[s, rows].argmax(-1))
            hits[s] += int((draft == greedy[rows + s]).sum())
            counts[s] += int(rows.numel())
    acc = [h / c if c else float("nan") for h, c in zip(hits, counts)]
    tau, run = 1.0, 1.0
    for a in acc:
        if a == a:
            run *= a
            tau += run
    return {"acceptance": acc, "tau": tau, "rows": counts[0] if counts else 0}


# --- the loop ---------------------------------------------------------------------------


@dataclass
class _Position:
    step: int = 0       # optimizer steps done
    epoch: int = 0
    batch: int = 0      # batches of this epoch done


class Trainer:
    """The loop (module doc). ``train``/``held_out``: store indices; ``loss_from[i]``:
    sequence i's first answer position (its prompt's length); ``folder``: where the
    checkpoint lives."""

    def __init__(self, head: Eagle3Head, store: FeatureStore, train: Sequence[int],
                 held_out: Sequence[int], loss_from: Sequence[int], vocab: DraftVocab,
                 cfg: TrainConfig, folder: str, *, fingerprint: str = "") -> None:
        cfg.check()
        if not train:
            raise ValueError("Trainer: train must hold at least one sequence, got none")
        self.cfg, self.store, self.folder = cfg, store, folder
        self.train, self.held_out = list(train), list(held_out)
        self.loss_from = list(loss_from)
        self.draft_index = vocab.draft_index()
        self.module = HeadParameters(head)
        self.head = head
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=cfg.lr,
                                           betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.fingerprint = fingerprint
        self.pos = _Position()
        self.history: list[dict] = []
        self._plans: dict[int, list[list[int]]] = {}
        self._total: Optional[int] = None

    # -- order and schedule --
    def plan(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s optimizer steps as lists of store indices."""
        if epoch not in self._plans:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            order = [self.train[j] for j in torch.randperm(len(self.train), generator=g)]
            batches, used = [[]], 0
            for i in order:
                n = min(self.store.length(i), self.cfg.max_seq_tokens)
                if batches[-1] and used + n > self.cfg.batch_tokens:
                    batches.append([])
                    used = 0
                batches[-1].append(i)
                used += n
            self._plans = {epoch: batches}
        return self._plans[epoch]

    @property
    def total_steps(self) -> int:
        if self._total is None:
            self._total = self.cfg.steps or sum(len(self.plan(e))
                                                for e in range(self.cfg.epochs))
        return self._total

    def lr_at(self, step: int) -> float:
        cfg, total = self.cfg, self.total_steps
        warm = min(cfg.warmup_steps, max(1, total // 20))
        if step < warm:
            return cfg.lr * (step + 1) / warm
        frac = (step - warm) / max(1, total - warm)
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    # -- checkpoints --
    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.folder, "checkpoint.pt")

    def save_checkpoint(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        state = {"fingerprint": self.fingerprint, "config": asdict(self.cfg),
                 "position": asdict(self.pos), "history": self.history,
                 "params": {n: p.detach().clone() for n, p in self.module.named().items()},
                 "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}
        tmp = self.checkpoint_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint_path)

    def load_checkpoint(self) -> bool:
        """Continue from the folder's checkpoint; False when there is none. ValueError
        when it was written for other data or settings."""
        if not os.path.isfile(self.checkpoint_path):
            return False
        state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(f"resume: {self.checkpoint_path} was written for other data or "
                             f"settings (fingerprint {state['fingerprint']}, expected "
                             f"{self.fingerprint})")
        with torch.no_grad():
            for n, p in self.module.named().items():
                p.copy_(state["params"][n].to(p.device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.pos = _Position(**state["position"])
        self.history = list(state["history"])
        torch.set_rng_state(state["rng"])
        return True

    # -- evaluation --
    def evaluate(self) -> dict:
        idx = self.held_out[: self.cfg.eval_sequences]
        if not idx:
            return {"acceptance": [], "tau": float("nan"), "rows": 0}
        return evaluate(self.head, self.store, idx, self.loss_from, self.cfg.ttt_steps,
                        self.cfg.max_seq_tokens)

    # -- training --
    def run(self, progress: Progress = None) -> dict:
        """Train to the end (from the checkpoint's position after ``load_checkpoint``);
        returns the last evaluation."""
        cfg, total = self.cfg, self.total_steps
        start_time, start_step, tokens_done = time.perf_counter(), self.pos.step, 0
        ema = None
        last_eval = self.history[-1]["eval"] if self.history and "eval" in self.history[-1] else None
        while self.pos.step < total:
            plan = self.plan(self.pos.epoch)
            if self.pos.batch >= len(plan):
                self.pos.epoch += 1
                self.pos.batch = 0
                continue
            batch = plan[self.pos.batch]
            denom = sum(counted_rows(min(self.store.length(i), cfg.max_seq_tokens),
                                     self.loss_from[i]) for i in batch)
            lr = self.lr_at(self.pos.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            batch_loss = 0.0
            for i in batch:
                seq = self.store.sequence(i)
                loss, _ = sequence_loss(self.head, seq, self.loss_from[i], cfg, self.draft_index)
                if denom:
                    (loss / denom).backward()
                    batch_loss += float(loss.detach()) / denom
                tokens_done += min(seq["tokens"].shape[0], cfg.max_seq_tokens)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.pos.step += 1
            self.pos.batch += 1
            ema = batch_loss if ema is None else 0.9 * ema + 0.1 * batch_loss
            record: dict[str, Any] = {"step": self.pos.step, "loss": batch_loss, "lr": lr}
            if self.pos.step % cfg.eval_every == 0 or self.pos.step == total:
                last_eval = self.evaluate()
                record["eval"] = last_eval
            self.history.append(record)
            if self.pos.step % cfg.checkpoint_every == 0 or self.pos.step == total:
                self.save_checkpoint()
            if progress is not None:
                elapsed = time.perf_counter() - start_time
                done = self.pos.step - start_step
                eta = elapsed / done * (total - self.pos.step) if done else 0.0
                acc = ("" if last_eval is None else " | held-out acc "
                       + "/".join(f"{a:.2f}" for a in last_eval["acceptance"])
                       + f" tau {last_eval['tau']:.2f}")
                progress(self.pos.step, total,
                         f"loss {ema:.3f} | {tokens_done / max(elapsed, 1e-9):.0f} tok/s | "
                         f"ETA {_clock(eta)}{acc}")
        if last_eval is None:
            last_eval = self.evaluate()
        return last_eval


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
