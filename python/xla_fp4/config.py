"""Every xla-fp4 option in one registry: name, environment variable, default, help.

Values come from `xla_fp4.enable(**options)` when given, else from the environment, else the default. Parsing is strict:
a bad value raises a ValueError naming the variable and the accepted values.
"""

import dataclasses
import difflib
import json
import os
import re
from typing import Any, Callable


def _parse_bool(text):
  value = str(text).strip().lower()
  if value in ("1", "true"):
    return True
  if value in ("0", "false"):
    return False
  raise ValueError("accepted values are 1, 0, true, false")


def _parse_choice(*choices):
  def parse(text):
    value = str(text).strip().lower()
    if value not in choices:
      raise ValueError(f"accepted values are {', '.join(choices)}")
    return value
  return parse


def _parse_count(text):
  value = str(text).strip().lower()
  if value == "auto":
    return "auto"
  if value.isdigit():
    return int(value)
  raise ValueError("accepted values are 'auto' or a non-negative integer")


def _parse_int(text):
  try:
    value = int(str(text).strip(), 0)
  except ValueError:
    raise ValueError("accepted values are integers") from None
  if value < 0:
    raise ValueError("accepted values are non-negative integers")
  return value


def _parse_positive(text):
  value = _parse_int(text)
  if value == 0:
    raise ValueError("accepted values are positive integers")
  return value


def _parse_float(text):
  try:
    return float(str(text).strip())
  except ValueError:
    raise ValueError("accepted values are numbers") from None


def _parse_fraction(text):
  value = _parse_float(text)
  if not 0 <= value <= 1:
    raise ValueError("accepted values are numbers from 0 to 1")
  return value


def _parse_regex(text):
  text = str(text)
  if text:
    try:
      re.compile(text)
    except re.error as e:
      raise ValueError(f"not a valid regular expression ({e})") from None
  return text


def _parse_str(text):
  return str(text)


ROLES = ("fprop", "dgrad", "wgrad")


@dataclasses.dataclass(frozen=True)
class UserRule:
  """One entry of the `rules` option. It matches a dot when each field given matches: `layer` by re.search on the layer
  path, `roles` and `blocks` by membership (empty: any). A dot of a scanned stack serves several blocks and has no
  single block number, so a rule with `blocks` never matches it (keep_first/keep_last select those blocks)."""
  name: str
  decision: str  # keep | nvfp4 | mxfp4 | mxfp8 (a format: quantized in it)
  reason: str
  layer: str = ""
  roles: tuple = ()
  blocks: tuple = ()


_RULE_KEYS = ("decision", "format", "layer", "role", "block", "name", "reason")
# The number formats by name, as numerics/formats.py FORMATS has them (a test checks): a rule's decision is keep or the
# format it quantizes in.
FORMATS = ("nvfp4", "mxfp4", "mxfp8")


def _as_tuple(value):
  return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _parse_rule(i, entry):
  if not isinstance(entry, dict):
    raise ValueError(f"rule {i} is {entry!r}; each rule is a dict such as "
                     '{"layer": "attention", "role": "wgrad", "decision": "keep"} or {"layer": "attn", "format": "mxfp8"}')
  unknown = sorted(set(entry) - set(_RULE_KEYS))
  if unknown:
    raise ValueError(f"rule {i} has unknown key(s) {unknown}; the keys are {list(_RULE_KEYS)}")
  decision, fmt = entry.get("decision"), entry.get("format")
  if fmt is not None and fmt not in FORMATS:
    raise ValueError(f"rule {i}: 'format' must be one of {list(FORMATS)}, got {fmt!r}")
  if fmt is not None and decision not in (None, "nvfp4", fmt):
    raise ValueError(f"rule {i}: 'format' {fmt!r} quantizes; it cannot go with 'decision' {decision!r}")
  decision = fmt or decision
  if decision not in ("keep", "nvfp4", *FORMATS):
    raise ValueError(f"rule {i}: 'decision' must be 'keep' or a format ({', '.join(FORMATS)}), or give 'format', "
                     f"got {decision!r}")
  layer = entry.get("layer", "")
  if not isinstance(layer, str):
    raise ValueError(f"rule {i}: 'layer' must be a regular expression string, got {layer!r}")
  try:
    re.compile(layer)
  except re.error as e:
    raise ValueError(f"rule {i}: 'layer' {layer!r} is not a valid regular expression ({e})") from None
  roles = _as_tuple(entry.get("role", ()))
  if not set(roles) <= set(ROLES):
    raise ValueError(f"rule {i}: 'role' must be one or a list of {list(ROLES)}, got {entry['role']!r}")
  blocks = _as_tuple(entry.get("block", ()))
  if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
    raise ValueError(f"rule {i}: 'block' must be a block number or a list of them (0 = the first), "
                     f"got {entry['block']!r}")
  name = entry.get("name", f"user_rule_{i}")
  what = ", ".join(f"{k}={entry[k]!r}" for k in ("layer", "role", "block") if k in entry) or "every dot"
  reason = entry.get("reason", f"user rule {name} ({what})")
  if not isinstance(name, str) or not isinstance(reason, str):
    raise ValueError(f"rule {i}: 'name' and 'reason' must be strings")
  return UserRule(name=name, decision=decision, reason=reason, layer=layer, roles=roles, blocks=blocks)


def _parse_rules(value):
  """A JSON list (the environment) or a list of dicts (Python) -> tuple of UserRule."""
  if isinstance(value, str):
    try:
      value = json.loads(value) if value.strip() else []
    except json.JSONDecodeError as e:
      raise ValueError(f"not a JSON list of rules ({e})") from None
  if isinstance(value, dict) or not isinstance(value, (list, tuple)):
    raise ValueError("give a list of rules (dicts), first match wins")
  rules = tuple(value) if all(isinstance(r, UserRule) for r in value) else tuple(
      _parse_rule(i, r) for i, r in enumerate(value))
  names = [r.name for r in rules]
  clashes = sorted({n for n in names if names.count(n) > 1 or n in BUILTIN_RULES})
  if clashes:
    raise ValueError(f"rule name(s) {clashes} are used twice or by a built-in rule ({', '.join(BUILTIN_RULES)})")
  return rules


# The policy's own rules, in order (python/xla_fp4/passes/policy.py); user rules run after the first five, which
# say what the pass cannot take and which programs it leaves alone.
BUILTIN_RULES = ("ragged", "not_linear", "dtype", "contraction_not_16", "forward_only", "higher_order", "exclude_scope",
                 "exclude_regex", "tiny", "head", "high_precision_block", "nvfp4")
BEFORE_USER_RULES = BUILTIN_RULES[:5]


@dataclasses.dataclass(frozen=True)
class Option:
  name: str
  env: str
  default: Any
  parse: Callable[[Any], Any]
  help: str


OPTIONS = (
    Option("enabled", "XLA_FP4", False, _parse_bool,
           "Install the pass: every jit compilation is rewritten to NVFP4 per the policy."),
    Option("backend", "XLA_FP4_BACKEND", "auto", _parse_choice("auto", "emulate", "native"),
           "emulate: exact NVFP4 numerics with high-precision GEMMs (any platform); native: packed FP4 operands and an "
           "FP4 GEMM (cuBLASLt on sm_100+, a C++ reference GEMM on CPU); auto: native where an FP4 GEMM runs, else "
           "emulate."),
    Option("format", "XLA_FP4_FORMAT", "nvfp4", _parse_choice(*FORMATS),
           "The number format of every rewritten GEMM: nvfp4 (E2M1, an E4M3 scale per 16, an FP32 tensor scale), "
           "mxfp4 (E2M1, an E8M0 scale per 32) or mxfp8 (E4M3, an E8M0 scale per 32). Rules can choose per layer. The MX "
           "formats run the emulated GEMM (docs/design.md §2)."),
    Option("kept_format", "XLA_FP4_KEPT_FORMAT", "high", _parse_choice("high", "mxfp8"),
           "What the policy's kept layers (the kept blocks and the output head) run in: high (the program's "
           "precision) or mxfp8."),
    Option("four_over_six", "XLA_FP4_FOUR_OVER_SIX", False, _parse_bool,
           "NVFP4 refinement (Four Over Six, arXiv 2512.02010): each block takes the scale that maps its largest "
           "magnitude to 4 or to 6, whichever decodes it with less error. Dense GEMMs, on the emulated GEMM."),
    Option("rht", "XLA_FP4_RHT", True, _parse_bool,
           "16x16 random Hadamard transform on both wgrad operands."),
    Option("stochastic_rounding", "XLA_FP4_STOCHASTIC_ROUNDING", True, _parse_bool,
           "Stochastic rounding of gradients (dgrad and wgrad gradient operands)."),
    Option("weights_2d", "XLA_FP4_2D_WEIGHTS", True, _parse_bool,
           "16x16 block scaling of weights (else 1x16 like activations)."),
    Option("keep_first", "XLA_FP4_KEEP_FIRST", "auto", _parse_count,
           "Blocks at the start of the network kept in high precision; auto: 1/5 of round(16% of the blocks)."),
    Option("keep_last", "XLA_FP4_KEEP_LAST", "auto", _parse_count,
           "Blocks at the end of the network kept in high precision; auto: the other 4/5 of round(16% of blocks)."),
    Option("keep_head", "XLA_FP4_KEEP_HEAD", True, _parse_bool,
           "Keep the output head (logits) GEMMs in high precision."),
    Option("exclude", "XLA_FP4_EXCLUDE", "", _parse_regex,
           "Regex (re.search) on the layer path: matching layers stay in high precision."),
    Option("rules", "XLA_FP4_RULES", (), _parse_rules,
           'Your own rules, first match wins, before the built-in policy (after the checks of what the kernels take): '
           'a JSON list such as `[{"layer": "attn", "role": "wgrad", "decision": "keep"}]`; keys `decision` (keep or '
           'nvfp4), `layer` (regex on the layer path), `role`, `block` (a value or a list), `name`, `reason`.'),
    Option("forward_only", "XLA_FP4_FORWARD_ONLY", False, _parse_bool,
           "Also rewrite programs without a backward pass (eval, sampling, init, eager ops), which are otherwise left "
           "exactly as they are; their head is the linear layer whose output reaches the program's result with no "
           "other linear layer in between."),
    Option("min_dim", "XLA_FP4_MIN_DIM", 16, _parse_int,
           "GEMMs with M, N or K below this stay in high precision."),
    Option("seed", "XLA_FP4_SEED", 0, _parse_int,
           "Seed of the RHT sign vector and of the stochastic-rounding keys."),
    Option("dump_dir", "XLA_FP4_DUMP_DIR", "", _parse_str,
           "Write {n:04d}_{module}.before.mlir, .after.mlir and .decisions.json/.txt for every compiled module."),
    Option("strict", "XLA_FP4_STRICT", False, _parse_bool,
           "Raise on an internal pass error instead of compiling the original module with a warning; with telemetry, "
           "a gradient operand that quantizes to all zeros fails its step."),
    Option("telemetry", "XLA_FP4_TELEMETRY", "", _parse_str,
           "Directory: record what quantization does to every operand of every NVFP4 GEMM (amax, underflow, block "
           "scales, SNR; wgrad zeros) into DIR/telemetry.jsonl; `python -m xla_fp4 telemetry DIR` reads it."),
    Option("telemetry_every", "XLA_FP4_TELEMETRY_EVERY", 1, _parse_positive,
           "Record telemetry every N steps (executions of a training step), from the first."),
    Option("telemetry_underflow", "XLA_FP4_TELEMETRY_UNDERFLOW", 0.1, _parse_fraction,
           "Warn (once per GEMM operand) when more than this fraction of an operand's nonzero elements quantize to "
           "zero."),
    Option("telemetry_snr_db", "XLA_FP4_TELEMETRY_SNR_DB", 5.0, _parse_float,
           "Warn (once per GEMM operand) when an operand's quantization SNR falls below this many dB."),
    Option("packed_gathers", "XLA_FP4_PACKED_GATHERS", False, _parse_bool,
           "With the emulate backend in a sharded program, quantize on the shard and move packed operands (4.5 bits "
           "an element), dequantizing on each device: FSDP's weight gathers shrink, but tensor parallelism holds more "
           "temporary memory (docs/performance.md has the numbers). Dots whose weight every "
           "device holds whole (data parallelism) keep the emulated form: nothing is gathered. The native backend "
           "always moves packed operands."),
)
_BY_NAME = {o.name: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class Config:
  enabled: bool
  backend: str
  format: str  # noqa: A003
  kept_format: str
  four_over_six: bool
  rht: bool
  stochastic_rounding: bool
  weights_2d: bool
  keep_first: Any
  keep_last: Any
  keep_head: bool
  exclude: str
  rules: tuple
  forward_only: bool
  min_dim: int
  seed: int
  dump_dir: str
  strict: bool
  telemetry: str
  telemetry_every: int
  telemetry_underflow: float
  telemetry_snr_db: float
  packed_gathers: bool


def _parse(option, value, source):
  try:
    return option.parse(value)
  except ValueError as e:
    raise ValueError(f"{source} = {value!r} is invalid: {e}. ({option.help})") from None


# Variables the build reads (CMakeLists.txt), not the pass.
BUILD_VARIABLES = ("XLA_FP4_CUDA",)


def unknown_variables(environ=None):
  """One line for each XLA_FP4_* variable of `environ` that nothing reads (a misspelt option does nothing), naming the
  closest known variable."""
  environ = os.environ if environ is None else environ
  known = sorted({o.env for o in OPTIONS} | set(BUILD_VARIABLES))
  lines = []
  for var in sorted(v for v in environ if v.startswith("XLA_FP4") and v not in known):
    close = difflib.get_close_matches(var, known, n=1, cutoff=0.85)
    hint = f"did you mean {close[0]}?" if close else "`python -m xla_fp4 options` lists the variables"
    lines.append(f"xla_fp4: {var} is not an xla_fp4 variable and does nothing; {hint}")
  return lines


def load(environ=None, **overrides) -> Config:
  """Build a Config from `overrides` (Python names) over the environment over the defaults."""
  environ = os.environ if environ is None else environ
  unknown = set(overrides) - set(_BY_NAME)
  if unknown:
    raise TypeError(f"unknown xla_fp4 option(s) {sorted(unknown)}; known options: {sorted(_BY_NAME)}")
  values = {}
  for o in OPTIONS:
    if o.name in overrides:
      values[o.name] = _parse(o, overrides[o.name], f"option {o.name}")
    elif o.env in environ:
      values[o.name] = _parse(o, environ[o.env], f"environment variable {o.env}")
    else:
      values[o.name] = o.default
  return Config(**values)


def markdown_table():
  """The option table rendered into the README."""
  rows = ["| option | environment variable | default | meaning |", "|---|---|---|---|"]
  for o in OPTIONS:
    default = {True: "1", False: "0"}.get(o.default, o.default) if isinstance(o.default, bool) else o.default
    rows.append(f"| `{o.name}` | `{o.env}` | `{default if default != '' else '(empty)'}` | {o.help} |")
  return "\n".join(rows)
