"""Early exit's depth from measured acceptance (verispec.cli.calibrate): the candidate
depths, the cost model's estimate, and the choice on a model."""

import pytest

from verispec.cli.calibrate import (Calibration, calibrate_early_exit, candidate_depths,
                                    estimated_speedup)


def test_candidate_depths():
    assert candidate_depths(30) == [8, 15, 22, 28]   # SmolLM2-135M
    assert candidate_depths(8) == [2, 4, 6]
    assert candidate_depths(3) == [1, 2]
    assert candidate_depths(2) == [1]


def test_estimate_follows_the_cost_model():
    # nothing accepted: one proposal (k = 1) loses least, and loses: 1 / (1 + 0.25 + 0.05)
    speed, k = estimated_speedup(0.0, 0.25, 8)
    assert k == 1 and speed == pytest.approx(1 / 1.3)
    # every proposal accepted by a free draft: the longest chain, (k + 1) / (1 + k c)
    speed, k = estimated_speedup(1.0, 0.0, 4)
    assert k == 4 and speed == pytest.approx(5 / 1.2)
    # the figures for SmolLM2: 0.52 at 28 of 30 layers does not pay
    speed, k = estimated_speedup(0.52, 28 / 30, 8)
    assert k == 1 and speed == pytest.approx(1.52 / (1 + 28 / 30 + 0.05))
    # a draft at a tenth of the cost accepting 0.8 does
    speed, k = estimated_speedup(0.8, 0.1, 8)
    assert speed > 1.5 and 2 <= k <= 8


def test_choice_and_advice():
    cal = Calibration(num_layers=30, acceptance={8: 0.05, 15: 0.08, 22: 0.31, 28: 0.52},
                      estimate={8: 0.76, 15: 0.64, 22: 0.72, 28: 0.77}, depth=28)
    assert not cal.pays
    assert cal.advice().startswith("early exit does not pay on this prompt: at the best depth "
                                   "(28 of 30 layers, acceptance 0.52) the cost model "
                                   "estimates 0.77x of plain decoding; try --draft ngram")
    assert "8: 0.05, 15: 0.08, 22: 0.31, 28: 0.52" in cal.describe()


def test_calibrate_on_a_model(tmp_path):
    """A model whose draft at every depth equals the target (an 8-layer Llama whose layers
    after the first add nothing: zero output projections) accepts everything: the
    shallowest depth wins, and it pays."""
    from toymodels import write_tiny_llama
    from verispec.models import load
    import safetensors.torch as st

    folder = write_tiny_llama(tmp_path, "{{ messages }}", layers=8)
    state = st.load_file(str(folder / "model.safetensors"))
    for i in range(1, 8):
        state[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        state[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    st.save_file(state, str(folder / "model.safetensors"))
    model, tok = load(folder)
    cal = calibrate_early_exit(model, tok.encode("the quick brown fox jumps over the lazy dog"), 8)
    assert set(cal.acceptance) == {2, 4, 6}
    assert all(a == 1.0 for a in cal.acceptance.values()), cal.acceptance
    assert cal.depth == 2 and cal.pays
