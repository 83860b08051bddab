"""``verispec serve``: load the model and its draft, warm up, and hand a SpecDecoder to
verispec.server (fastapi and uvicorn, the serve extra)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

from verispec.cli.common import (BLOCK_SIZE, UsageError, _check_device, _check_draft_options,
                                 _load, _make_draft,
                                 _model_kind, _warm_up, _weights_desc)

SERVE_NEEDS = ("fastapi", "uvicorn")
WARM_UP_TEXT = ("The quick brown fox jumps over the lazy dog. The council met on Tuesday to "
                "discuss the new park, and residents asked for more trees and benches.")


def _api_keys(args: argparse.Namespace) -> dict:
    """{key: tenant} of --api-key and --api-keys-file (empty: an open server)."""
    from verispec.server.auth import DEFAULT_TENANT, read_keys_file

    keys: dict = {}
    if getattr(args, "api_keys_file", None):
        if not os.path.isfile(args.api_keys_file):
            raise UsageError(f"argument --api-keys-file: expected a readable file, got "
                             f"{args.api_keys_file!r} (no such file)")
        try:
            keys.update(read_keys_file(args.api_keys_file))
        except ValueError as e:
            raise UsageError(f"argument --api-keys-file: {e}") from None
    key = getattr(args, "api_key", None)
    if key is not None:
        if not key or any(c.isspace() for c in key):
            raise UsageError(f"argument --api-key: expected a non-empty key without spaces, "
                             f"got {key!r}")
        keys[key] = DEFAULT_TENANT
    return keys


def cmd_serve(args: argparse.Namespace) -> int:
    missing = [name for name in SERVE_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"verispec serve needs the Python packages {', '.join(missing)} "
                         f"(the serve extra): pip install 'verispec[serve]'")
    import torch

    from verispec import server
    from verispec.decoder import SpecDecoder

    _check_draft_options(args)
    _check_device(args.device)
    api_keys = _api_keys(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model, tok = _load(args.model, "--model", device=args.device, dtype=dtype,
                       batch_invariant=args.batch_invariant, cuda_graphs=args.cuda_graphs)
    load_s = time.perf_counter() - t0
    # an early-exit draft without --early-exit-layers calibrates its depth on this text
    text = tok.encode(WARM_UP_TEXT) or [0]
    draft, draft_desc, draft_arg = _make_draft(args, model, tok, args.device, dtype, text)
    k = 0 if draft is None else args.k
    _warm_up(model, draft, text, draft_arg)
    try:
        dec = SpecDecoder(model, draft, k=k, max_k=args.max_k, num_blocks=args.num_blocks,
                          block_size=BLOCK_SIZE, seed=args.seed, max_num_seqs=args.max_num_seqs,
                          max_tokens_per_step=args.max_tokens_per_step)
    except ValueError as e:
        raise UsageError(f"argument {draft_arg or '--k'}: {e}") from None
    name = args.served_model_name or args.model
    print(f"[verispec serve: {args.model} ({_model_kind(model)}, {model.geometry.num_layers} "
          f"layers, {_weights_desc(model)} on {args.device}"
          f"{', batch-invariant' if args.batch_invariant else ''}, loaded "
          f"in {load_s:.1f} s) as {name!r}; draft {draft_desc}, "
          f"k {k if k != 'auto' else f'auto (<= {args.max_k})'}; {args.num_blocks} KV blocks "
          f"of {BLOCK_SIZE} tokens; http://{args.host}:{args.port}/v1]", file=sys.stderr, flush=True)
    if api_keys:
        print(f"[verispec serve: {len(api_keys)} API key(s), tenants "
              f"{', '.join(sorted(set(api_keys.values())))}]", file=sys.stderr, flush=True)
    server.serve(dec, tok, name, host=args.host, port=args.port, log_level=args.log_level,
                 default_max_tokens=args.default_max_tokens, api_keys=api_keys)
    return 0
