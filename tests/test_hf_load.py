"""verispec.models.load on Hugging Face folders of any architecture and on model ids in
the local Hugging Face cache.

Tiny random transformers models (Llama, Qwen2 sharded, Mistral, Gemma2, and a Llama with
attention biases the native model does not run) are saved with save_pretrained next to a
byte-level BPE tokenizer.json. load() must pick the native LlamaModel for the plain Llama
and transformers (HFModel) for the rest, and its logits through the paged cache must
equal transformers' own forward on the same folder. Nothing comes from the network: ids
resolve in a fake hub cache built under tmp_path, with socket connections recorded.
"""

import json
import os
import socket
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub

import transformers  # noqa: E402

import verispec.models as vm  # noqa: E402
from verispec.models import hf_folder, loaders  # noqa: E402
from verispec.models.testing import PagedRunner, randomize_weights  # noqa: E402
from verispec.models.tokenizer import vocabulary_fingerprint  # noqa: E402
from toymodels import train_byte_bpe  # noqa: E402

ATOL = 1e-5  # float32 logits (O(1..10)) against transformers' eager forward
CORPUS = ["the quick brown fox jumps over the lazy dog", "speculative decoding is exact",
          "a paged cache of blocks", "hello world, 1234 tokens!"] * 4
OTHER_CORPUS = ["lorem ipsum dolor sit amet", "consectetur adipiscing elit"] * 8
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
# name -> (model_type, config overrides, save_pretrained kwargs, the class load() returns)
CASES = {
    "llama": ("llama", dict(tie_word_embeddings=False), {}, "LlamaModel"),
    "llama_bias": ("llama", dict(attention_bias=True), {}, "HFModel"),
    "qwen2_sharded": ("qwen2", dict(sliding_window=5, use_sliding_window=True, max_window_layers=1,
                                    layer_types=["full_attention", "sliding_attention",
                                                 "sliding_attention"]),
                      dict(max_shard_size="40KB"), "HFModel"),
    "mistral": ("mistral", dict(sliding_window=5), {}, "HFModel"),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=5, attn_logit_softcapping=5.0,
                              final_logit_softcapping=8.0), {}, "HFModel"),
}


def save_folder(folder, hf_model, tokenizer, **save_kw):
    """save_pretrained + tokenizer.json + tokenizer_config.json: a Hugging Face folder."""
    hf_model.save_pretrained(folder, **save_kw)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>"}))
    return folder


def tiny_hf_model(model_type, vocab_size, seed, **overrides):
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, "vocab_size": vocab_size,
                                                              **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    return randomize_weights(model, seed).float().eval()


def reference(folder):
    """transformers' own model from the folder (eager attention, float32)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def byte_bpe():
    return train_byte_bpe(CORPUS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, byte_bpe):
    """name -> folder for each case."""
    out = {}
    for seed, (name, (model_type, overrides, save_kw, _)) in enumerate(CASES.items()):
        hf = tiny_hf_model(model_type, byte_bpe.get_vocab_size(), seed, **overrides)
        out[name] = save_folder(tmp_path_factory.mktemp(name), hf, byte_bpe, **save_kw)
    return out


def paged_logits_match(model, ref, *, atol=ATOL):
    """Prefill two rows in one forward, decode, verify-style ragged rows, a rollback and
    a single row, all through a real BlockAllocator with 4-token blocks (windows of 5
    cross blocks); each logits row against ``ref`` over the whole sequence. Returns the
    largest difference."""
    vocab = model.geometry.vocab_size
    runner = PagedRunner(model, num_blocks=64, block_size=4)
    g = torch.Generator().manual_seed(7)
    toks = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    a, b = runner.add_sequence(), runner.add_sequence()
    history = {a: [], b: []}
    worst = 0.0

    def step(new):
        nonlocal worst
        for s, ids in new.items():
            history[s] = history[s][:runner.length(s)] + ids
        for s, got in zip(new, runner.step(new)):
            with torch.no_grad():
                want = ref(torch.tensor([history[s]])).logits[0, -len(new[s]):]
            assert got.shape == want.shape
            diff = (got.float() - want).abs().max().item()
            worst = max(worst, diff)
            assert diff < atol, f"row {s}: max |logit diff| {diff:.2e} at length {len(history[s])}"

    step({a: toks(11), b: toks(6)})
    for _ in range(2):
        step({a: toks(1), b: toks(1)})
    step({a: toks(4), b: toks(3)})
    runner.rollback(a, runner.length(a) - 3)
    step({a: toks(2), b: toks(5)})
    step({b: toks(1)})
    return worst


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("name", list(CASES))
def test_load_picks_the_model_and_matches_transformers(folders, byte_bpe, name):
    folder = folders[name]
    model, tok = vm.load(folder)
    assert type(model).__name__ == CASES[name][3]
    assert model.geometry.dtype == torch.float32 and model.geometry.device.type == "cpu"
    assert model.geometry.vocab_size == byte_bpe.get_vocab_size()
    assert tok.encode("the lazy dog") == byte_bpe.encode("the lazy dog").ids
    paged_logits_match(model, reference(folder))
    if name == "qwen2_sharded":
        shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
        assert not (folder / "model.safetensors").exists()


def test_native_support_is_the_native_configs_own_test(folders):
    def cfg(name):
        return json.loads((folders[name] / "config.json").read_text())

    llama = cfg("llama")
    assert hf_folder.native_refusal(llama) is None and hf_folder.supports_natively(llama)
    assert loaders.hf_backend(str(folders["llama"])) == ("native", None)
    refusals = {
        "qwen2": (cfg("qwen2_sharded"), "unsupported model_type 'qwen2'"),
        "bias": (cfg("llama_bias"), "attention_bias = true is not supported"),
        "gelu": ({**llama, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        "yarn": ({**llama, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                               "rope_theta": 1e4}}, "unsupported rope type 'yarn'"),
        "partial": ({**llama, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        "quantized": ({**llama, "quantization_config": {"quant_method": "gptq"}}, "'gptq'"),
        "no_heads": ({k: v for k, v in llama.items() if k != "num_attention_heads"},
                     "no 'num_attention_heads' entry"),
    }
    for what, (config, needle) in refusals.items():
        reason = hf_folder.native_refusal(config)
        assert reason is not None and needle in reason, (what, reason)
        assert not hf_folder.supports_natively(config)
    backend, reason = loaders.hf_backend(str(folders["mistral"]))
    assert backend == "transformers" and "unsupported model_type 'mistral'" in reason


def test_tokenizer_fingerprint_on_every_model(folders, byte_bpe, tmp_path):
    want = vocabulary_fingerprint(byte_bpe)
    other = vocabulary_fingerprint(train_byte_bpe(OTHER_CORPUS))
    assert want != other
    for name in ("llama", "qwen2_sharded"):
        folder = folders[name]
        model, tok = vm.load(folder)
        assert model.tokenizer_fingerprint == want == vocabulary_fingerprint(tok), name
        assert vm.load_model(folder).tokenizer_fingerprint == want, name
        # the map that fingerprint hashes is transformers' own tokenizer's for the folder
        hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
        assert tok.backend.get_vocab(with_added_tokens=True) == hf_tok.get_vocab()
        # a transformers tokenizer (whose .backend is a string) hashes to the same value
        assert vocabulary_fingerprint(hf_tok) == want
        if isinstance(model, vm.HFModel):
            assert vm.HFModel(model.model, tokenizer=hf_tok).tokenizer_fingerprint == want
    # load_model of a folder without tokenizer.json: the model, no fingerprint; load refuses
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in folders["mistral"].iterdir():
        if not f.name.startswith("tokenizer"):
            (bare / f.name).write_bytes(f.read_bytes())
    assert vm.load_model(bare).tokenizer_fingerprint is None
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        vm.load(bare)


# --------------------------------------------------------------------------- dtype, device


def test_dtype_bfloat16_honoured(folders):
    for name in ("llama", "mistral"):
        model = vm.load_model(folders[name], dtype=torch.bfloat16)
        assert model.geometry.dtype == torch.bfloat16, name
        if name == "mistral":
            assert {p.dtype for p in model.model.parameters()} == {torch.bfloat16}
        else:
            assert model.weights.embed.dtype == torch.bfloat16
        runner = PagedRunner(model, num_blocks=8, block_size=4)
        ids = list(range(3, 13))
        got = runner.step({runner.add_sequence(): ids})[0]
        assert got.dtype == torch.bfloat16
        with torch.no_grad():
            want = reference(folders[name])(torch.tensor([ids])).logits[0]
        assert (got.float() - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_default_dtype_and_device(folders, byte_bpe, tmp_path):
    # A checkpoint saved in bfloat16: float32 on the CPU, its own dtype on a GPU.
    hf = tiny_hf_model("qwen2", byte_bpe.get_vocab_size(), 9).to(torch.bfloat16)
    folder = save_folder(tmp_path / "bf16", hf, byte_bpe)
    assert hf_folder.checkpoint_dtype(json.loads((folder / "config.json").read_text())) \
        == torch.bfloat16
    model = vm.load_model(folder)
    assert model.geometry.dtype == torch.float32 and model.geometry.device == torch.device("cpu")
    assert loaders.default_dtype("hf", str(folder), "cpu") == torch.float32
    assert loaders.default_dtype("hf", str(folder), "cuda") == torch.bfloat16
    assert loaders.default_dtype("hf", str(folders["llama"]), "cuda:0") == torch.float32
    assert loaders.default_dtype("gguf", "any.gguf", "cuda") == torch.float32
    assert hf_folder.checkpoint_dtype({"torch_dtype": "float16"}) == torch.float16  # 4.x key
    assert hf_folder.checkpoint_dtype({"text_config": {"dtype": "bfloat16"}}) == torch.bfloat16
    assert hf_folder.checkpoint_dtype({}) is None


def test_max_context(folders):
    assert vm.load_model(folders["gemma2"], max_context=64).geometry.max_context == 64
    assert vm.load_model(folders["llama"], max_context=64).geometry.max_context == 64
    assert vm.load_model(folders["gemma2"]).geometry.max_context == 256


# --------------------------------------------------------------------------- the HF cache


def fake_hub_cache(root, model_id, folder, commit="0123456789abcdef0123456789abcdef01234567"):
    """The hub cache layout: models--org--name/{blobs, snapshots/<commit>, refs/main},
    snapshot files symlinked to blobs as huggingface_hub stores them."""
    storage = root / ("models--" + model_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(folder.iterdir())):
        blob = storage / "blobs" / f"blob{i:04d}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    """Records (and refuses) every name lookup and socket connection, with
    huggingface_hub's offline switch off, so only the loader keeps it off the network."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError(f"test: no network {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    try:
        import huggingface_hub.constants as hub_constants
    except ImportError:
        pass
    else:
        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    return attempts


@pytest.fixture
def hub_env(monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("with_hub", [True, False], ids=["huggingface_hub", "cache_layout"])
def test_model_id_from_the_local_cache(folders, tmp_path, hub_env, no_network, with_hub):
    if not with_hub:  # the loader reads the cache layout itself
        hub_env.setitem(sys.modules, "huggingface_hub", None)
    folder = folders["qwen2_sharded"]
    snapshot = fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen", folder)
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    assert loaders.resolve("tiny-org/tiny-qwen") == ("hf", str(snapshot))
    model, tok = vm.load("tiny-org/tiny-qwen")
    assert isinstance(model, vm.HFModel)
    assert model.tokenizer_fingerprint == vm.load_model(folder).tokenizer_fingerprint
    assert vm.load_tokenizer("tiny-org/tiny-qwen").encode("hello world") == tok.encode("hello world")
    paged_logits_match(model, reference(folder))

    # HF_HOME/hub when HF_HUB_CACHE is unset; a bare id ("name") too
    hub_env.delenv("HF_HUB_CACHE")
    fake_hub_cache(tmp_path / "home" / "hub", "tiny-llama", folders["llama"])
    hub_env.setenv("HF_HOME", str(tmp_path / "home"))
    assert isinstance(vm.load_model("tiny-llama"), vm.LlamaModel)
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        vm.load("tiny-org/tiny-qwen")  # it is in the other cache
    assert no_network == []


@pytest.mark.parametrize("with_hub", [True, False], ids=["huggingface_hub", "cache_layout"])
def test_missing_model_id(tmp_path, hub_env, no_network, with_hub):
    if not with_hub:
        hub_env.setitem(sys.modules, "huggingface_hub", None)
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    entry = str(tmp_path / "empty" / "models--org--missing")
    with pytest.raises(FileNotFoundError) as e:
        vm.load("org/missing")
    for needle in ("'org/missing'", "not in the local Hugging Face cache", entry,
                   "never downloads"):
        assert needle in str(e.value), str(e.value)
    with pytest.raises(FileNotFoundError, match=r"unknown model 'missing'.*never downloads"):
        vm.load("missing")
    # refs/main naming a snapshot that is not there
    storage = tmp_path / "empty" / "models--org--missing"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text("f" * 40)
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        vm.load_model("org/missing")
    assert no_network == []


# --------------------------------------------------------------------------- errors


def test_errors(folders, tmp_path, monkeypatch):
    config = json.loads((folders["qwen2_sharded"] / "config.json").read_text())
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        vm.load(only_config)

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    for f in folders["qwen2_sharded"].iterdir():
        (unknown / f.name).write_bytes(f.read_bytes())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no-such-arch"}))
    with pytest.raises(ValueError, match=r"could not load it as a causal LM.*no-such-arch"):
        vm.load(unknown)

    with pytest.raises(ValueError, match=r"dtype must be None or one of .*got torch\.int8"):
        vm.load(folders["llama"], dtype=torch.int8)
    with pytest.raises(ValueError, match=r"device must name a torch device.*'gpu0'"):
        vm.load(folders["llama"], device="gpu0")

    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    with pytest.raises(ModuleNotFoundError,
                       match=r"runs through transformers.*model_type 'qwen2'.*pip install "
                             r"transformers"):
        vm.load(folders["qwen2_sharded"])
    assert isinstance(vm.load_model(folders["llama"]), vm.LlamaModel)  # native: no transformers
