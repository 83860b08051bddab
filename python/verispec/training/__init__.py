"""Training an EAGLE-3 head for the user's own target (``verispec train-head``).

    from verispec.training import TrainHeadOptions, train_head
    report = train_head(target, tokenizer, "my-head", TrainHeadOptions(num_prompts=800))
    dec = SpecDecoder(target, Eagle3(target, "my-head"))

Modules, one job each: ``options`` (every setting and its default), ``data`` (prompts:
a file or written by the target; the target's answers), ``vocab`` (the draft
vocabulary and its maps), ``features`` (the frozen target's states and distributions,
on disk), ``trainer`` (the head, the training-time-test loss, the loop, checkpoints,
held-out acceptance), ``run`` (the stages end to end, resumable). ``train_head`` is
imported on first use, so reading the options needs no torch.
"""

from typing import Any

from verispec.training.options import TrainConfig, TrainHeadOptions

__all__ = ["TrainConfig", "TrainHeadOptions", "train_head"]


def __getattr__(name: str) -> Any:
    if name == "train_head":
        from verispec.training.run import train_head

        return train_head
    raise AttributeError(f"module 'verispec.training' has no attribute {name!r}")
