"""n-gram lookup across requests: NGram(memory=NGramMemory()) copies from a tenant's
earlier requests and answers, never across the separators between texts, never from
another tenant's (unless the memory is shared), within a bounded memory; the output
stays the target's (greedy identical to plain greedy)."""

import pytest
import torch
import transformers

from verispec import _C
from verispec.decoder import SpecDecoder
from verispec.drafters import NGram, NGramMemory
from verispec.models import load_model
from verispec.models.testing import randomize_weights

VOCAB = 61


def test_proposals_stop_at_a_separator():
    index = _C.NGramIndex(1, 3)
    index.extend([5, 6, 7, -1, 9, 5])
    assert index.propose(4) == [6, 7]                 # the continuation ends at the separator
    index = _C.NGramIndex(1, 3)
    index.extend([1, 2, 3, -1, 8, 3])
    assert index.propose(4) == []                     # 3 ends its text: nothing after it
    index = _C.NGramIndex(1, 3)
    index.extend([3, 4, -1, 1, 2, 3, -1, 0, 3])
    assert index.propose(3) == [4]                    # the later 3 ends its text, the earlier not
    tokens, parents = index.propose_tree(4, 2)
    assert tokens == [4] and parents == [-1]


def test_memory_keeps_texts_per_tenant_within_its_bound():
    m = NGramMemory(max_tokens=10)
    m.remember("a", [1, 2, 3, 4])
    m.remember("a", [5, 6, 7])
    m.remember("b", [9])
    assert m.context("a") == [1, 2, 3, 4, -1, 5, 6, 7] and m.context("b") == [9]
    m.remember("a", [8, 8, 8, 8])                     # 11 tokens > 10: the oldest goes
    assert m.context("a") == [5, 6, 7, -1, 8, 8, 8, 8] and m.tokens("a") == 7
    m.remember("a", list(range(30)))                  # longer than the bound: its tail
    assert m.context("a") == list(range(20, 30))
    assert m.context("nobody") == []
    shared = NGramMemory(100, shared=True)
    shared.remember("a", [1, 2])
    assert shared.context("b") == [1, 2]
    m.clear("a")
    assert m.context("a") == [] and m.context("b") == [9]
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        NGramMemory(0)
    with pytest.raises(ValueError, match="tenant must be a non-empty str"):
        m.context("")
    with pytest.raises(ValueError, match="ids >= 0"):
        m.remember("a", [1, -1])
    with pytest.raises(TypeError, match="memory must be an NGramMemory"):
        NGram(memory=[1, 2])


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mem_target")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=VOCAB, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    randomize_weights(transformers.LlamaForCausalLM(cfg), 3).eval().save_pretrained(
        folder, safe_serialization=True)
    return load_model(folder)


def _prompt(seed, n=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _run(dec, prompt, tenant):
    r = dec.generate([prompt], max_new_tokens=40, greedy=True, tenant=tenant)[0]
    return r.tokens, r.stats["accepted"], r.stats["proposed"]


def test_a_repeated_request_copies_its_earlier_answer_and_only_its_tenants(target):
    """A prompt decoded again copies from the first answer (many more accepted tokens
    than the prompt alone gives); another tenant's identical request gets nothing from
    it (the same proposals as a decoder without memory), a shared memory does; every
    output is plain greedy's."""
    prompt = _prompt(1)
    plain = SpecDecoder(target, None, num_blocks=64).generate([prompt], max_new_tokens=40,
                                                              greedy=True)[0].tokens
    alone = SpecDecoder(target, NGram(1, 3), k=4, num_blocks=64)
    base = _run(alone, prompt, "x")
    memory = NGramMemory(4096)
    dec = SpecDecoder(target, NGram(1, 3, memory=memory), k=4, num_blocks=64)
    first = _run(dec, prompt, "alice")
    assert first == base                              # an empty memory changes nothing
    assert memory.tokens("alice") == len(prompt) + len(plain)
    again = _run(dec, prompt, "alice")
    other = _run(dec, prompt, "bob")
    assert first[0] == again[0] == other[0] == base[0] == plain
    assert again[1] >= base[1] + 12                   # copied from the first answer
    assert other == base                              # bob drafts from nothing of alice's
    shared_memory = NGramMemory(4096, shared=True)
    dec = SpecDecoder(target, NGram(1, 3, memory=shared_memory), k=4, num_blocks=64)
    _run(dec, prompt, "alice")
    assert _run(dec, prompt, "bob")[1] >= base[1] + 12
    # aborted requests are not remembered; released ones leave nothing behind
    dec = SpecDecoder(target, NGram(1, 3, memory=NGramMemory(4096)), k=4, num_blocks=64)
    seq = dec.add(prompt, max_new_tokens=40, greedy=True, tenant="carol")
    dec.step()
    dec.abort(seq)
    dec.release(seq)
    assert dec.ngram_memory.tokens("carol") == 0 and not dec._tenant
    with pytest.raises(ValueError, match="tenant must be a non-empty str"):
        dec.add(prompt, max_new_tokens=4, tenant="")


def test_the_core_checks_the_context(target):
    dec = SpecDecoder(target, NGram(1, 3), k=4, num_blocks=64)
    with pytest.raises(ValueError, match=r"ngram_context\[1\] must be in \[-1, 61\)"):
        dec._core.add([1, 2], 4, 1.0, 0, 1.0, 0.0, [], [], ngram_context=[3, -2])
    plain = SpecDecoder(target, None, num_blocks=64)
    with pytest.raises(ValueError, match="ngram_context needs n-gram drafting"):
        plain._core.add([1, 2], 4, 1.0, 0, 1.0, 0.0, [], [], ngram_context=[3])
