"""The settings of a head's training, with their defaults (plain dataclasses: the
command line reads the defaults without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["TrainConfig", "TrainHeadOptions"]


@dataclass
class TrainConfig:
    """Every setting of the loop that changes the weights, with its default."""

    ttt_steps: int = 4             # S: steps of the training-time-test unroll
    step_weight: float = 0.8       # step s's loss weight is step_weight ** s
    lr: float = 1e-3               # peak AdamW learning rate
    min_lr_ratio: float = 0.1      # cosine decay to lr * min_lr_ratio
    warmup_steps: int = 20         # linear warm-up (at most 5% of the steps)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0         # max global gradient norm (0: none)
    batch_tokens: int = 4096       # tokens per optimizer step (whole sequences)
    max_seq_tokens: int = 1024     # longer sequences are cut (the answer's tail)
    epochs: int = 2                # passes over the training set ...
    steps: int = 0                 # ... or this many optimizer steps when > 0
    hard_weight: float = 0.1       # loss = (1 - w) soft + w hard
    seed: int = 0
    checkpoint_every: int = 50     # optimizer steps between checkpoints
    eval_every: int = 100          # optimizer steps between held-out evaluations
    eval_sequences: int = 64       # held-out sequences an evaluation reads (at most)

    def check(self) -> None:
        def fail(name, expected):
            raise ValueError(f"TrainConfig: {name} must be {expected}, got "
                             f"{getattr(self, name)!r}")
        for name in ("ttt_steps", "batch_tokens", "max_seq_tokens", "checkpoint_every",
                     "eval_every", "eval_sequences"):
            if getattr(self, name) < 1:
                fail(name, "an int >= 1")
        for name in ("epochs", "steps", "warmup_steps", "seed"):
            if getattr(self, name) < 0:
                fail(name, "an int >= 0")
        if self.epochs == 0 and self.steps == 0:
            fail("epochs", ">= 1 when steps is 0")
        if not self.lr > 0:
            fail("lr", "> 0")
        if not 0 <= self.hard_weight <= 1:
            fail("hard_weight", "a weight from 0 to 1")
        if not 0 < self.step_weight <= 1:
            fail("step_weight", "a weight above 0 and at most 1")



@dataclass
class TrainHeadOptions:
    """The data and model settings of a run (the loop's are ``train``).

    Sized for SmolLM2-135M on 2 CPU cores: 800 prompts of about 66 tokens (system prompt
    and question) with answers of up to 192 tokens, about 190k tokens. Rates measured on
    this machine under a load of 6-9 (other jobs): self-written prompts 0.6/s, answers 34
    tokens/s (batch 16, quantized target), features 270 tokens/s, training (16K draft
    vocabulary, 3-4 steps) 60-500 tokens/s; an unloaded machine is 2-4x faster."""

    prompts_file: Optional[str] = None     # the user's prompts; None: the target writes them
    num_prompts: int = 800                 # self-written prompts (a file: its first N; 0: all)
    prompt_temperature: float = 1.0        # sampling the self-written prompts
    max_prompt_tokens: int = 96            # a self-written prompt cut here is dropped
    max_answer_tokens: int = 192           # the target's answers
    answer_temperature: float = 0.0        # 0: greedy answers (what greedy decoding meets)
    generation_batch: int = 16             # sequences decoded at once
    held_out: float = 0.05                 # fraction of sequences kept for evaluation
    draft_vocab: int = 16384               # draft vocabulary size (at most the target's)
    taps: Optional[tuple[int, ...]] = None  # "entering layer i"; None: default_taps
    top_k: int = 32                        # soft targets kept per token (0: the whole draft vocab)
    feature_batch_tokens: int = 2048       # tokens per target pass when extracting
    keep_draft_vocab: int = 0              # the head written drafts over this many of the
    #                                        draft vocabulary's ids, the most frequent in the
    #                                        answers first (0: all; a smaller file and pass)
    save_dtype: str = "float32"            # the written tensors: float32, bfloat16, float16
    train: TrainConfig = field(default_factory=TrainConfig)
