"""Names: what an op's location says about it (name stack, source frames, phase) and the layer paths built from the
name stack and from the weight's @main argument path.

JAX writes the name stack as the op's outermost NameLoc (`loc("jit(step)/transpose(jvp(MLP))/fc1/dot_general"(...))`)
and the Python call that made the op as nested file locations. The jaxlib 0.10 MLIR bindings expose no accessors for
location structure, so names are read from the printed location: only the leading quoted NameLoc name is taken.
Names name things; they decide nothing the dataflow can decide (roles, heads and blocks come from the dataflow).
"""

import re

from xla_fp4.passes.analysis.records import Phase

_NAME_LOC_RE = re.compile(r'^loc\("((?:[^"\\]|\\.)*)"(\(|\)$)')
_FILE_LOC_RE = re.compile(r'"((?:[^"\\]|\\.)*)":(\d+):(\d+)')
_TRANSFORM_RE = re.compile(r"^[\w.]+\((.*)\)$")  # jvp(MLP), transpose(jvp(MLP)), vmap(f), jit(step)
_NOISE = {"while", "body", "eval_jaxpr", "cond", "closed_call", "checkpoint", "rematted_computation", "remat", "remat2",
          "core_call", "custom_jvp_call", "custom_vjp_call", "pjit", "shard_map", "scan"}
_INDEXED_RE = re.compile(r"^(.*?)_?(\d+)$")  # a path component that numbers a module: layers_3, block3, 3
HEAD_RE = re.compile(r"(head|logits|unembed|embed\w*|lm_out|output_projection)$", re.I)


def name_of(loc) -> str:
  """The leading name of a location (or of its text: printing a location is the costly part, so callers reuse it)."""
  m = _NAME_LOC_RE.match(loc if isinstance(loc, str) else str(loc))
  if not m:
    return ""
  name = m.group(1)
  return name.encode().decode("unicode_escape") if "\\" in name else name  # escapes are rare: decode where there are


def frame_of(loc) -> str:
  """The location without its leading name: identifies the source frame (the Python call that made the op)."""
  text = loc if isinstance(loc, str) else str(loc)
  m = _NAME_LOC_RE.match(text)
  return text[m.end(1) + 1:] if m else text


def frames_of(loc) -> tuple:
  """The source frames (file, line, column) of an op's location, innermost first."""
  return tuple(_FILE_LOC_RE.findall(frame_of(loc)))


def same_frame(a, b):
  """Frames of one Python call. Backward and remat copies of an op carry more outer frames than the forward op (the
  scan body's or checkpoint's callers; JAX elides frames differently per trace), so: the same innermost frame, and the
  shorter frame list a subsequence of the longer."""
  if not a or not b or a[0] != b[0]:
    return False
  short, long_ = (a, b) if len(a) <= len(b) else (b, a)
  rest = iter(long_)
  return all(f in rest for f in short)


def phase_of(stack) -> Phase:
  """Backward iff the name stack holds `transpose(` outside a `rematted_computation` (remat recomputes forward work)."""
  return Phase.BACKWARD if "transpose(" in stack and "rematted_computation" not in stack else Phase.FORWARD


def higher_order(stack) -> bool:
  """A `transpose(` inside a `jvp(`, or two `transpose(`: the derivative of a derivative. (Two `jvp(` alone are no
  sign: MaxText's rematted forward is `jvp(jvp(...))`.)"""
  return "jvp(transpose(" in stack or stack.count("transpose(") > 1


def _strip_transform(component):
  while True:
    m = _TRANSFORM_RE.match(component)
    if not m:
      return component
    component = m.group(1)


def layer_path(name_stack: str) -> str:
  """The name stack without transforms, noise scopes, einsum specs and the op name: `MLP/fc1`."""
  parts = []
  for c in name_stack.split("/")[:-1]:  # the last component is the op name
    if c.startswith(("jit(", "pjit(")):
      continue
    c = _strip_transform(c)
    if c and c not in _NOISE and not c.startswith(("branch_", "jit:")) and "->" not in c and \
        (not parts or parts[-1] != c):
      # Dropped: einsum specs (jnp.einsum's own scope) and repeats (nn.scan names the lifted module and the
      # scanned one alike).
      parts.append(c)
  return "/".join(parts)


_LEAF_NAMES = {"params", "kernel", "w", "weight", "weights", "embedding"}
_ATTRS = {"value", "raw_value", "data_array"}  # NNX's Variable.value, penzai's NamedArray.data_array: no module


def path_from_arg(arg_name: str) -> str:
  """p['params']['block_0']['fc1']['kernel'] -> block_0/fc1 (the layer of a weight, for NNX and plain pytrees). The
  weight's own leaf names are dropped (kernel, w, ...), and NNX's `.value` attribute, not a module named `value`
  (state['attn']['value']['kernel'].value -> attn/value)."""
  keys = re.findall(r"\[\s*'?([^'\]]+)'?\s*\]|\.(\w+)", arg_name)
  parts = [key or attr for key, attr in keys
           if (key and key not in _LEAF_NAMES) or (attr and attr not in _LEAF_NAMES | _ATTRS)]
  # Haiku's module names join a module and the modules it made with "/~/" (block_0/mlp/~/linear_0)
  return "/".join(p for p in "/".join(parts).split("/") if p != "~")


def leaf_numbered(paths):
  """Whether parameter paths are positions in a flat list of leaves (`states/0/23` under nnx.jit, `leaves[5]` from
  jax.tree.leaves, penzai's unbind_params): at least two, each ending in a bare number. Such numbers count leaves, not
  modules."""
  paths = list(paths)
  return len(paths) >= 2 and all(p.split("/")[-1].isdigit() for p in paths)


def layer_of(stack_path, arg_name):
  """The layer of a linear dot: the name-stack path (linen module names, named scopes), completed with the weight's
  argument path where the name stack does not name the weight's module (NNX, plain pytrees); where both name it, the
  fuller of the two, and where they overlap (linen's `LM/block_0/moe` and `block_0/moe/w_in`) the overlap once."""
  arg_path = path_from_arg(arg_name) if arg_name else ""
  if not arg_path:
    return stack_path
  if not stack_path:
    return arg_path
  arg_parts, stack_parts = arg_path.split("/"), stack_path.split("/")
  if len(arg_parts) > len(stack_parts) and arg_parts[-len(stack_parts):] == stack_parts:
    return arg_path  # the parameter path names the same module more fully (Haiku's name_scope: block_1/attn/query)
  last = arg_parts[-1]
  if last in stack_parts and any(_INDEXED_RE.match(p) and p not in stack_parts for p in arg_parts[:-1]):
    # The name stack lost the block the parameters number (a linen block applied under jax.checkpoint to
    # params['blocks'][1] is Block/attn in every block): the parameter path names the layer.
    return arg_path
  if any(c == last or c.startswith(last + ".") for c in stack_parts):
    return stack_path
  overlap = next((k for k in range(min(len(arg_parts), len(stack_parts)), 0, -1)
                  if stack_parts[-k:] == arg_parts[:k]), 0)
  return "/".join(stack_parts + arg_parts[overlap:])


def indexed_subtrees(path):
  """[(stack, index, rest)] for each numbered component of a parameter path, outermost first:
  decoder/layers_3/mlp/wi_0 -> [("decoder/layers", 3, "mlp/wi_0"), ("decoder/layers_3/mlp/wi", 0, "")]."""
  parts = path.split("/") if path else []
  out = []
  for n, part in enumerate(parts):
    m = _INDEXED_RE.match(part)
    if m:
      stem = m.group(1) if m.group(1) else ""
      out.append(("/".join(parts[:n] + ([stem] if stem else [])), int(m.group(2)), "/".join(parts[n + 1:])))
  return out


def argument_names(main):
  """The names of @main's arguments (their locations: JAX names them by pytree path), `arg<i>` where unnamed: a
  sequence that reads each name when first asked for it (a train step has hundreds of arguments that no dot reads,
  and printing a location is the costly part)."""
  return _ArgumentNames(main.regions[0].blocks[0].arguments if main is not None else ())


class _ArgumentNames:
  """argument_names' sequence: name i is read at the first [i]."""

  def __init__(self, arguments):
    self._arguments, self._names = arguments, {}

  def __len__(self):
    return len(self._arguments)

  def __getitem__(self, i):
    name = self._names.get(i)
    if name is None:
      a = self._arguments[i]
      name = self._names[i] = name_of(a.location) or f"arg{a.arg_number}"
    return name
