"""``verispec info``: the build, torch, the GPUs, the packages and the default model, as
text or JSON."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
from typing import Optional

from verispec.cli.common import DEFAULT_MODEL, UsageError

# pip install 'verispec[EXTRA]': the packages each extra adds that `info` looks for
EXTRAS = {"models": ("gguf", "safetensors", "tokenizers", "jinja2"),
          "hf": ("transformers",), "plot": ("matplotlib",), "serve": ("fastapi", "uvicorn")}


def _quant_arithmetic() -> str:
    """The quantized kernels' arithmetic and code path: "int8 avx512-vnni" or "float avx512"
    (VERISPEC_QUANT_ARITHMETIC)."""
    import verispec
    from verispec.models.layers import quantized

    if quantized.ARITHMETIC == "int8":
        return f"int8 {verispec._C.quant_int8_path()}"
    return f"float {verispec._C.linear_best_isa()}"


def collect_info(head: Optional[str] = None) -> dict:
    """Everything ``verispec info`` reports, as a JSON-able dict (``head``: an EAGLE-3
    head's folder to describe; None: the shipped one)."""
    import verispec

    info: dict = {"verispec": verispec.__version__, "build": verispec.build_info(),
                  "python": platform.python_version(),
                  "python_executable": sys.executable, "platform": platform.platform(),
                  "machine": platform.machine(), "cpu_count": os.cpu_count()}
    try:
        import torch
    except ImportError:
        info["torch"] = None
    else:
        cuda = torch.cuda.is_available()
        info["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                         "cuda_available": cuda, "num_threads": torch.get_num_threads(),
                         "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                         if cuda else [],
                         # how the ops take torch tensors: the DLPack C exchange API or __dlpack__
                         "tensor_import": verispec._C._dlpack_import_path(torch.empty(0))}
    info["packages"] = {name: importlib.util.find_spec(name) is not None
                        for name in ("gguf", "safetensors", "tokenizers", "jinja2", "matplotlib",
                                     "scipy", "transformers", "fastapi", "uvicorn")}
    # the extras a user installs by name (pyproject.toml), and whether each is complete here
    info["extras"] = {extra: all(info["packages"][n] for n in needs)
                      for extra, needs in EXTRAS.items()}
    model: dict = {"name": DEFAULT_MODEL}
    try:
        from verispec.models.loaders import KNOWN_MODELS, resolve

        model["package"] = KNOWN_MODELS[DEFAULT_MODEL].package
        model["install"] = KNOWN_MODELS[DEFAULT_MODEL].pip_install
        model["path"] = resolve(DEFAULT_MODEL)[1]
        model["installed"] = True
        from verispec.models.gguf_file import GGUFFile
        from verispec.models.layers.quantized import quant_format_name

        # which kernel each of its matrices runs in when loaded on the CPU (dtype auto)
        types = sorted({(quant_format_name(t.ggml_type) or "float32 (dequantized)")
                        for t in GGUFFile(model["path"]).tensors.values() if len(t.shape) == 2})
        model["cpu_matrix_kernels"] = types
    except (ImportError, FileNotFoundError, ValueError) as e:
        model["installed"] = False
        model["error"] = str(e)
    info["default_model"] = model
    from verispec.models.layers import quantized

    from verispec.models.layers.linear import NATIVE_LINEAR_MAX_ROWS, NATIVE_LINEAR_MIN_ROWS

    info["cpu_kernels"] = {
        "float32_linear": f"{verispec._C.linear_best_isa()} (float32 models: passes of "
                          f"{NATIVE_LINEAR_MIN_ROWS}-{NATIVE_LINEAR_MAX_ROWS} tokens, decode "
                          f"and verify; longer prefills: torch.mm)",
        "quantized_linear": f"{_quant_arithmetic()}, formats "
                            f"{', '.join(verispec._C.quant_formats())} (GGUF on CPU, dtype auto: "
                            f"int8: every product; float: 1-{quantized.KERNEL_MAX_ROWS} tokens, "
                            f"longer prefills: dequantized {quantized.PREFILL_TILE_ROWS}-row "
                            f"tiles into torch.mm)",
        "threads": verispec._C.linear_threads()}
    loading: dict = {"native": "GGUF files, Hugging Face Llama folders",
                     "transformers": "other Hugging Face causal LM folders (HFModel)",
                     "transformers_installed": info["packages"]["transformers"]}
    try:
        from verispec.models.loaders import hf_cache_dir

        loading["hf_cache"] = hf_cache_dir()
    except ImportError:
        loading["hf_cache"] = None
    info["model_loading"] = loading
    info["eagle3_head"] = describe_head(head)
    return info


def describe_head(path: Optional[str]) -> dict:
    """An EAGLE-3 head's folder as ``verispec info`` names it: its layout, taps (entering
    target layer i; None: the engines' default, resolved against the target), draft
    vocabulary and sizes; ``path`` None: the head shipped for the bundled model."""
    from verispec.drafters.eagle3 import default_head_path

    shipped = path is None
    path = default_head_path() if shipped else path
    if path is None:
        return {"path": None, "shipped": True, "note": "this build ships no EAGLE-3 head for "
                f"{DEFAULT_MODEL} (verispec train-head writes one; --draft-head DIR reads it)"}
    from verispec.drafters.eagle3_head import Eagle3Config, layout_of

    try:
        with open(os.path.join(path, "config.json")) as f:
            layout = layout_of(json.load(f))
        cfg = Eagle3Config.from_folder(path)
    except (OSError, ValueError) as e:
        return {"path": path, "shipped": shipped, "error": str(e)}
    return {"path": path, "shipped": shipped, "layout": layout,
            "taps": None if cfg.tap_layers is None else list(cfg.tap_layers),
            "draft_vocab_size": cfg.draft_vocab_size, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "target_hidden_size": cfg.target_hidden_size,
            "layer_type": cfg.layer_type}


def _head_line(h: dict) -> str:
    if h.get("path") is None:
        return f"EAGLE-3 head  none: {h['note']}"
    if "error" in h:
        return f"EAGLE-3 head  {h['path']}: unreadable ({h['error']})"
    taps = h["taps"] if h["taps"] is not None else "default (2, N/2, N-3)"
    return (f"EAGLE-3 head  {h['path']}{' (shipped)' if h['shipped'] else ''}: {h['layout']} "
            f"layout, {h['layer_type']} layer of {h['hidden_size']}, taps entering target "
            f"layers {taps}, draft vocabulary {h['draft_vocab_size']} of {h['vocab_size']}")


def cmd_info(args: argparse.Namespace) -> int:
    head = getattr(args, "draft_head", None)
    if head is not None and not os.path.isdir(head):
        raise UsageError(f"argument --draft-head: expected the folder of an EAGLE-3 head, got "
                         f"{head!r}: not a folder")
    info = collect_info(head)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    b, t, m, ml = info["build"], info["torch"], info["default_model"], info["model_loading"]
    archs = b.get("cuda_architectures") or "-"
    lines = [
        f"verispec      {info['verispec']}",
        f"native build  CUDA kernels {'compiled (' + archs + ')' if b.get('cuda_compiled') else 'not compiled'}"
        f", {b.get('compiler', '?')}, DLPack {b.get('dlpack_version', '?')}",
        f"GPU (runtime) {b.get('num_gpus', 0)} seen by verispec"
        + ("" if b.get("gpu_available") else " (CPU path only)"),
        f"CPU linear    {info['cpu_kernels']['float32_linear']}",
        f"CPU quantized {info['cpu_kernels']['quantized_linear']}",
    ]
    if t is None:
        lines.append("torch         not installed (pip install torch)")
    else:
        gpus = ", ".join(t["gpus"]) if t["gpus"] else "none"
        lines.append(f"torch         {t['version']} (CUDA {t['cuda'] or '-'}; "
                     f"available: {t['cuda_available']}; GPUs: {gpus}; {t['num_threads']} threads)")
        lines.append(f"tensor import {t['tensor_import']} (how the ops take torch tensors)")
    lines += [
        f"python        {info['python']} ({info['python_executable']})",
        f"platform      {info['platform']}, {info['cpu_count']} CPUs",
        "packages      " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["packages"].items()),
        "extras        " + ", ".join(
            f"{k} {'yes' if v else f'no (pip install {chr(39)}verispec[{k}]{chr(39)})'}"
            for k, v in info["extras"].items()),
        f"default model {m['name']}: " + (f"installed ({m['path']}; CPU matrix kernels: "
                                          f"{', '.join(m['cpu_matrix_kernels'])})" if m["installed"]
                                          else f"NOT installed: {m['install'] if 'install' in m else m['error']}"),
        f"model loading native: {ml['native']}; through transformers: {ml['transformers']}"
        + ("" if ml["transformers_installed"] else " (needs: pip install transformers)"),
        f"HF cache      {ml['hf_cache'] or '-'} (model ids resolve here; verispec never downloads)",
        _head_line(info["eagle3_head"]),
    ]
    print("\n".join(lines))
    return 0
