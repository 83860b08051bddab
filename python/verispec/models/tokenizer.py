"""Tokenizers for the models verispec loads, built on the `tokenizers` package (imported lazily).

`Tokenizer` wraps a `tokenizers.Tokenizer` with what a decoding loop needs: encode,
decode, the stop ids, and chat templates rendered the way transformers renders them
(sandboxed Jinja, trim_blocks, lstrip_blocks, loop controls, tojson, raise_exception).

Sources:
- a GGUF file: byte-level BPE (tokenizer.ggml.model = "gpt2") from the vocabulary,
  merges and token types in its metadata, split the way llama.cpp splits for the file's
  tokenizer.ggml.pre;
- a Hugging Face folder: tokenizer.json, with tokenizer_config.json (chat template,
  special tokens), chat_template.jinja and generation_config.json (stop ids) if present.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import tokenizers

# llama.cpp's pre-tokenizer families (llama-vocab.cpp), as tokenizers pre-tokenizers.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt2", "gpt-2")
_DIGITS_PRE = ("smollm", "starcoder", "refact")  # "\p{N}" split first, then GPT-2's regex
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")
SUPPORTED_GGUF_PRE_TOKENIZERS = _GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    """Text <-> token ids, stop ids, chat template.

    encode(text) adds BOS only when the source says so (``add_bos``); a chat template
    writes its own special tokens, so apply_chat_template(tokenize=True) adds none.
    """

    def __init__(self, backend: "tokenizers.Tokenizer", *, eos_token_ids: Sequence[int],
                 bos_token_id: Optional[int] = None, add_bos: bool = False,
                 chat_template: Optional[str] = None, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None):
        self.backend = backend
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.bos_token = bos_token if bos_token is not None else self._token(bos_token_id)
        self.eos_token = eos_token if eos_token is not None else self._token(
            self.eos_token_ids[0] if self.eos_token_ids else None)
        self._compiled_template: Any = None

    def _token(self, token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def eos_token_id(self) -> Optional[int]:
        """The first stop id (the source's eos token); see ``eos_token_ids`` for all."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> Union[str, list[int]]:
        """Renders ``messages`` ([{"role": ..., "content": ...}, ...]) with the source's template."""
        if self.chat_template is None:
            raise ValueError("apply_chat_template: this tokenizer's source has no chat template")
        if self._compiled_template is None:
            self._compiled_template = _jinja_environment().from_string(self.chat_template)
        text = self._compiled_template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={list(self.eos_token_ids)}, "
                f"bos_token_id={self.bos_token_id}, chat_template={self.chat_template is not None})")


def _jinja_environment() -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def tokenizer_from_gguf_metadata(metadata: dict[str, Any], path: str) -> Tokenizer:
    """A byte-level BPE tokenizer from a GGUF file's tokenizer.ggml.* metadata."""
    import tokenizers
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: unsupported tokenizer.ggml.model {kind!r}; verispec builds "
                         f"byte-level BPE tokenizers ('gpt2') from GGUF files")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_GGUF_PRE_TOKENIZERS:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.pre {pre!r}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=pre in _LLAMA3_PRE)
    backend = tokenizers.Tokenizer(bpe)
    if pre in _LLAMA3_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGITS_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>...) and user-defined ones are matched whole in text.
    types = metadata.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])

    eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in metadata]
    return Tokenizer(backend, eos_token_ids=eos,
                     bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
                     add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                     chat_template=metadata.get("tokenizer.chat_template"))


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(token: Any) -> Optional[str]:
    return token.get("content") if isinstance(token, dict) else token


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def tokenizer_from_hf_folder(folder: str) -> Tokenizer:
    """tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json)."""
    import tokenizers

    tokenizer_json = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        raise FileNotFoundError(f"{folder}: no tokenizer.json; verispec reads Hugging Face "
                                f"tokenizers from tokenizer.json (a fast-tokenizer file)")
    backend = tokenizers.Tokenizer.from_file(tokenizer_json)
    tok_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()

    bos_token = _token_content(tok_config.get("bos_token"))
    eos_token = _token_content(tok_config.get("eos_token"))
    # Stop ids: what generation uses (generation_config.json, else config.json), then the
    # tokenizer's eos token.
    eos_ids = (_ids(_read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id"))
               or _ids(_read_json(os.path.join(folder, "config.json")).get("eos_token_id")))
    if eos_token is not None and backend.token_to_id(eos_token) is not None:
        eos_ids.append(backend.token_to_id(eos_token))
    bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
    # BOS, if any, comes from tokenizer.json's post-processor (add_special_tokens=True).
    return Tokenizer(backend, eos_token_ids=eos_ids, bos_token_id=bos_id, add_bos=False,
                     chat_template=template, bos_token=bos_token, eos_token=eos_token)


def vocabulary_fingerprint(tokenizer: Any) -> str:
    """A hash of a tokenizer's token -> id map: two tokenizers with the same fingerprint
    map every token to the same id, so a draft and a target may share token ids.

    Accepts verispec's Tokenizer, a ``tokenizers.Tokenizer`` or a transformers tokenizer
    (anything with ``get_vocab()``, or a ``backend`` that has it).
    """
    import hashlib

    get_vocab = getattr(tokenizer, "get_vocab", None)  # transformers, tokenizers
    if get_vocab is None:  # verispec's Tokenizer wraps a tokenizers.Tokenizer
        get_vocab = getattr(getattr(tokenizer, "backend", None), "get_vocab", None)
    if get_vocab is None:
        raise TypeError(f"vocabulary_fingerprint: expected a tokenizer with get_vocab(), "
                        f"got {type(tokenizer).__name__}")
    try:
        vocab = get_vocab(with_added_tokens=True)
    except TypeError:
        vocab = get_vocab()
    h = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]
