"""One rule for the sampling policy's ranges (csrc/include/verispec/policy_rules.h).

temperature, top_k, top_p and min_p are checked by the native ``policy_error``, which
every layer asks: ``verispec._C.check_policy``, the ops (scalars in Python, per-row
tensors in the kernels), ``verispec.reference`` and the CLI's option types. So a value
is accepted or rejected alike everywhere, with the same message. And greedy is one thing
inside the library: temperature 0 (the public ``greedy=`` arguments fold into it).

The last tests keep it that way: a second copy of the range text in python/ or csrc/
fails them.
"""

import math
import re
from pathlib import Path

import pytest
import torch

from verispec import _C, cli, ops, reference

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("temperature", "top_k", "top_p", "min_p")
DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # always accepted
OPTIONS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
           "min_p": "--min-p"}

FLOATS = [0.0, 1.0, -0.0, 0.5, 0.1, -0.5, 1.5, 2.0, math.inf, -math.inf, math.nan,
          1e-45, -1e-45, 1e-46, -1e-46, 1 + 1e-7, 1 + 1e-9, 1 - 1e-9, 1e30, 1e39, -1e39,
          2, -1, 0, 1, 2**31, 10**30]
INTS = [0, 1, 3, -1, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, -2**63,
        10**30, -10**30]
GRID = [(name, value) for name in NAMES for value in (INTS if name == "top_k" else FLOATS)]
IDS = [f"{name}={value!r}" for name, value in GRID]


def rule(**given):
    """The native rule's verdict on scalars: '' (accepted) or its message."""
    args = {**DEFAULTS, **given}
    try:
        _C.check_policy(**args)
    except ValueError as e:
        return str(e)
    return ""


def verdict(op, fn):
    """'' if fn() runs, else the message of its ValueError without the '<op>: ' prefix."""
    try:
        fn()
    except ValueError as e:
        message = str(e)
        assert message.startswith(f"{op}: "), message
        return message[len(op) + 2:]
    return ""


LOGITS = torch.tensor([[0.5, 2.0, -1.0, 0.0], [1.0, 1.0, 0.0, -2.0]])
TARGET = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
DRAFTS = torch.tensor([[1, 2], [0, 3]])


def cli_verdict(capsys, name, value):
    """'' if the generate parser takes --<name> value, else its message for the option."""
    option = OPTIONS[name]
    try:
        args = cli.build_parser().parse_args(["generate", "--prompt", "x", f"{option}={value!r}"])
    except SystemExit:
        err = capsys.readouterr().err.strip().splitlines()[-1]
        prefix = f"argument {option}: "
        assert prefix in err, err
        return err[err.index(prefix) + len(prefix):]
    parsed, given = getattr(args, name), int(value) if name == "top_k" else float(value)
    assert parsed == given or (math.isnan(given) and math.isnan(parsed))
    return ""


# --- the rule itself -------------------------------------------------------------------


@pytest.mark.parametrize("given,message", [
    (dict(temperature=math.inf), "temperature must be finite and >= 0, got inf"),
    (dict(temperature=-math.inf), "temperature must be finite and >= 0, got -inf"),
    (dict(temperature=math.nan), "temperature must be finite and >= 0, got nan"),
    (dict(temperature=-0.5), "temperature must be finite and >= 0, got -0.5"),
    (dict(temperature=-1e-45), "temperature must be finite and >= 0, got -1e-45"),
    (dict(temperature=1e39), "temperature must be finite and >= 0, got 1e+39 (inf as float32)"),
    (dict(top_k=-1), "top_k must be >= 0, got -1"),
    (dict(top_k=-10**30), "top_k must be >= 0, got -1000000000000000000000000000000"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0"),
    (dict(top_p=-0.0), "top_p must be in (0, 1], got -0"),
    (dict(top_p=1 + 1e-7), "top_p must be in (0, 1], got 1.0000001"),
    (dict(top_p=1e-46), "top_p must be in (0, 1], got 1e-46 (0 as float32)"),
    (dict(top_p=1.1), "top_p must be in (0, 1], got 1.1"),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
    (dict(min_p=-0.25), "min_p must be in [0, 1], got -0.25"),
    # the first bad argument, in the order temperature, top_k, top_p, min_p
    (dict(temperature=-1.0, top_k=-1, top_p=2.0, min_p=2.0),
     "temperature must be finite and >= 0, got -1"),
    (dict(top_p=2.0, min_p=2.0, top_k=-3), "top_k must be >= 0, got -3"),
    (dict(top_p=2.0, min_p=2.0), "top_p must be in (0, 1], got 2"),
])
def test_messages_name_the_argument_its_range_and_the_value(given, message):
    assert rule(**given) == message


@pytest.mark.parametrize("given", [
    dict(), dict(temperature=0.0), dict(temperature=-0.0), dict(temperature=1e-45),
    dict(temperature=1e30), dict(top_k=2**31), dict(top_k=10**30), dict(top_p=1.0),
    dict(top_p=1e-45), dict(top_p=1 + 1e-9), dict(min_p=0.0), dict(min_p=-0.0),
    dict(min_p=1.0), dict(min_p=-1e-46),
])
def test_values_the_kernels_take_are_accepted(given):
    # Decided on what the kernels compute with: float32 (1 + 1e-9 is 1, -1e-46 is -0)
    # and int32 (a top_k past int32 is >= any vocabulary: off, like 2**31 - 1).
    assert rule(**given) == ""


def test_check_policy_takes_python_numbers_only_as_typed():
    with pytest.raises(TypeError):
        _C.check_policy(1.0, 2.5, 1.0, 0.0)  # top_k is an int
    with pytest.raises(TypeError):
        _C.check_policy("hot", 0, 1.0, 0.0)


# --- every layer asks it ----------------------------------------------------------------


@pytest.mark.parametrize("name,value", GRID, ids=IDS)
def test_every_layer_gives_the_rules_verdict_on_a_scalar(name, value, capsys):
    want = rule(**{name: value})
    got = {
        "ops.apply_policy": verdict("apply_policy", lambda: ops.apply_policy(LOGITS, **{name: value})),
        "ops.verify": verdict("verify", lambda: ops.verify(TARGET, DRAFTS, **{name: value})),
        "reference.apply_policy":
            verdict("apply_policy", lambda: reference.apply_policy(LOGITS, **{name: value})),
        "reference.verify": verdict("verify", lambda: reference.verify(TARGET, DRAFTS, **{name: value})),
        "_C.apply_policy": verdict("apply_policy", lambda: _C.apply_policy(
            LOGITS, torch.empty(2, 4), *(value if n == name else DEFAULTS[n] for n in NAMES))),
        "cli generate": cli_verdict(capsys, name, value),
    }
    assert got == dict.fromkeys(got, want)


@pytest.mark.parametrize("name,value", GRID, ids=IDS)
def test_a_per_row_value_gets_the_scalars_verdict_and_names_its_row(name, value):
    """Per-row tensors: the kernels (ops) and reference check each row with the same rule;
    the message is the one the row's value gets as a scalar, plus where it is."""
    if name == "top_k":
        rows = torch.tensor([3, max(-2**63, min(value, 2**63 - 1))])  # int64
        as_scalar = int(rows[1])
    else:
        rows = torch.tensor([DEFAULTS[name], value], dtype=torch.float32)
        as_scalar = float(rows[1])  # the value the kernels see
    want = rule(**{name: as_scalar})
    want = want and f"{want} at {name}[1]"
    kernel_range = name != "top_k" or -2**31 <= as_scalar  # ops pass top_k as int32
    for op, fn in [("apply_policy", lambda m: m.apply_policy(LOGITS, **{name: rows})),
                   ("verify", lambda m: m.verify(TARGET, DRAFTS, **{name: rows}))]:
        for module in (ops, reference):
            got = verdict(op, lambda: fn(module))
            if module is ops and not kernel_range:  # clamped to int32: same verdict
                assert bool(got) == bool(want) and got.endswith(f" at {name}[1]")
            else:
                assert got == want, (module.__name__, op)


def test_the_first_bad_row_and_its_first_bad_argument_are_reported_alike():
    temperature = torch.tensor([1.0, 1.0, -1.0, math.inf])
    top_p = torch.tensor([1.0, 2.0, 2.0, 1.0])
    logits = torch.zeros(4, 3)
    for module in (ops, reference):
        with pytest.raises(ValueError) as e:
            module.apply_policy(logits, temperature=temperature, top_p=top_p)
        assert str(e.value) == "apply_policy: top_p must be in (0, 1], got 2 at top_p[1]"
    temperature[1] = math.nan
    for module in (ops, reference):
        with pytest.raises(ValueError) as e:
            module.apply_policy(logits, temperature=temperature, top_p=top_p)
        assert str(e.value) == "apply_policy: temperature must be finite and >= 0, got nan " \
                               "at temperature[1]"


def test_under_torch_compile_the_binding_applies_the_same_rule():
    def step(logits):
        return ops.apply_policy(logits, temperature=math.inf)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    with pytest.raises(ValueError, match=re.escape(
            "apply_policy: temperature must be finite and >= 0, got inf")):
        compiled(LOGITS)


# --- greedy is temperature 0 ------------------------------------------------------------


def test_greedy_is_temperature_zero_in_ops_and_reference():
    target = torch.randn(4, 3, 9, generator=torch.Generator().manual_seed(3))
    drafts = target[:, :2].argmax(-1)
    drafts[1, 0] = (drafts[1, 0] + 1) % 9  # row 1 rejects at once
    for module in (ops, reference):
        as_flag = module.verify(target, drafts, greedy=True, temperature=0.7, top_k=3, seed=5)
        as_zero = module.verify(target, drafts, temperature=0.0, top_k=3, seed=5)
        assert all(torch.equal(a, b) for a, b in zip(as_flag, as_zero))
        rows = torch.tensor([True, False, True, False])
        per_row_flag = module.verify(target, drafts, greedy=rows, temperature=0.7, seed=6)
        per_row_zero = module.verify(target, drafts, temperature=torch.tensor([0.0, 0.7, 0.0, 0.7]),
                                     seed=6)
        assert all(torch.equal(a, b) for a, b in zip(per_row_flag, per_row_zero))


def test_greedy_still_checks_a_scalar_temperature():
    for module in (ops, reference):
        with pytest.raises(ValueError, match=re.escape(
                "verify: temperature must be finite and >= 0, got inf")):
            module.verify(TARGET, DRAFTS, greedy=True, temperature=math.inf)


def test_greedy_rows_take_temperature_zero_before_per_row_checks():
    # ops: folded, then the kernel checks rows; reference: the same order, same verdicts.
    temperature = torch.tensor([1.0, math.inf])
    for module in (ops, reference):
        module.verify(TARGET, DRAFTS, greedy=True, temperature=temperature)
        module.verify(TARGET, DRAFTS, greedy=torch.tensor([False, True]), temperature=temperature)
        with pytest.raises(ValueError, match=re.escape(
                "verify: temperature must be finite and >= 0, got inf at temperature[1]")):
            module.verify(TARGET, DRAFTS, greedy=torch.tensor([True, False]),
                          temperature=temperature)


def test_the_native_verify_has_no_greedy_flag():
    # Inside the library greedy is spelled one way: temperature 0.
    assert "greedy" not in _C.verify.__doc__
    assert "greedy" not in str(torch.ops.verispec.verify.default._schema)


def test_cli_greedy_is_temperature_zero():
    parse = cli.build_parser().parse_args
    greedy = cli._sampling(parse(["generate", "--prompt", "x", "--greedy"]))
    assert greedy == dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    assert cli._describe_policy(greedy) == "greedy"
    zero = cli._sampling(parse(["generate", "--prompt", "x", "--temperature", "0"]))
    assert zero == greedy
    sampled = cli._sampling(parse(["generate", "--prompt", "x", "--top-p", "0.9"]))
    assert sampled == dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0)
    assert cli._describe_policy(sampled) == "temperature 1, top-p 0.9"


# --- one copy of the range text ---------------------------------------------------------

SOURCES = sorted(p for folder in ("python", "csrc") for p in (ROOT / folder).rglob("*")
                 if p.suffix in {".py", ".pyi", ".h", ".cpp", ".cu", ".cuh"})
HOME = ROOT / "csrc/include/verispec/policy_rules.h"
# Files being rewritten elsewhere that still hold a copy; each entry says who removes it.
PENDING: dict[str, str] = {}  # path -> why it may still restate a range (none today)

_NAME = r"\b(temperature|top_k|top_p|min_p)\b"
_RANGE = r"(finite|>=|<=|in\s*[\[(]|non-negative|positive)"
COPY_PATTERNS = [
    # "top_p must be in (0, 1]", "add: temperature must be >= 0, got "
    re.compile(_NAME + r"[^\n]{0,12}?\bmust be\s+" + _RANGE),
    # a name and its range in separate strings: ("top_p", ..., "in (0, 1]")
    re.compile(r"[\"']" + _NAME + r"[\"'][\s\S]{0,160}?[\"']\s*(finite and >= 0|in [\[(]0, 1[\])]"
               r"|>= 0)"),
    # a range fragment as a string of its own
    re.compile(r"[\"'](finite and >= 0|in \(0, 1\]|in \[0, 1\])[\"']"),
    # a CLI policy option parsed by anything but the rule
    re.compile(r"\"--(temperature|top-k|top-p|min-p)\",\s*type=(?!_policy_value\b)"),
    # a second definition of a range predicate
    re.compile(r"\bbool\s+(temperature|top_k|top_p|min_p)_valid\s*\("),
    # a range as a comparison in code (the server's old "0 < top_p <= 1")
    re.compile(r"\b0(\.0)?f?\s*<=?\s*(top_p|min_p)\s*<=?\s*1|\b(temperature|top_k)\s*>=\s*0(\.0)?f?\b"),
]
PREDICATE_HOME = ROOT / "csrc/include/verispec/sampling_math.h"


def copies(path):
    text = path.read_text()
    found = []
    for pattern in COPY_PATTERNS:
        if path == PREDICATE_HOME and "_valid" in pattern.pattern:
            continue
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0).splitlines()[0].strip()}")
    return found


def test_the_range_text_has_one_home():
    assert HOME in SOURCES and len(SOURCES) > 40
    assert copies(HOME), "the patterns no longer see the rule's own text"
    found = [c for p in SOURCES if p != HOME and str(p.relative_to(ROOT)) not in PENDING
             for c in copies(p)]
    assert found == [], "policy ranges restated outside policy_rules.h: use policy_error"


def test_pending_exemptions_are_still_needed():
    for path, why in PENDING.items():
        assert copies(ROOT / path), f"{path} no longer restates a range ({why}): " \
                                    f"remove it from PENDING in {Path(__file__).name}"


@pytest.mark.parametrize("text", [
    'case PolicyField::kTopP: return "top_p must be in (0, 1]";',
    'throw InvalidArgumentError("add: temperature must be >= 0, got " +',
    '("top_p", p, p_rows, 0 < p <= 1, "in (0, 1]"),',
    '("top_k", top_k, top_k >= 0, ">= 0 (0 disables)"),',
    'check_scalar(op, "temperature", p.temperature_per_row, temperature_valid(p.temperature),\n'
    '             "finite and >= 0", p.temperature);',
    'raise ValueError(f"{op}: min_p must be in [0, 1], got {m}")',
    'g.add_argument("--top-p", type=_float_in(0, 1, low_open=True), help="nucleus mass")',
    'inline bool top_p_valid(float p) { return p > 0.0f && p <= 1.0f; }',
    'if not (_is_number(top_p) and 0 < top_p <= 1):',
    'if not (_is_number(min_p) and 0 <= min_p <= 1):',
    'if not (_is_number(temperature) and temperature >= 0):',
    'if not (_is_int(top_k) and top_k >= 0):',
])
def test_the_patterns_catch_the_old_copies(text):
    assert any(p.search(text) for p in COPY_PATTERNS), text


@pytest.mark.parametrize("text", [
    'raise TypeError(f"{op}: {name} must be a number or a 1-D tensor, got {value!r}")',
    'return "draft_probs must be finite and >= 0";',
    'g.add_argument("--top-p", type=_policy_value("top_p"), help="nucleus mass (1 = off)")',
    'throw py::type_error(std::string(op) + ": " + name + " must be an int, got " +',
    'VERISPEC_HD inline bool top_p_active(float top_p) { return top_p < 1.0f; }',
    'if (top_k > 0 && top_k < n) thr = sorted[top_k - 1];',
])
def test_the_patterns_leave_other_rules_alone(text):
    assert not any(p.search(text) for p in COPY_PATTERNS), text
