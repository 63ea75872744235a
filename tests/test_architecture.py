"""The package's shape (docs/design.md §3): imports run one way and form no cycle, the rewrite reads the analysis
only through its records, the cost model names no target, and no module outgrows 400 lines."""

import ast
import pathlib

from xla_fp4.kernels import targets

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "xla_fp4"
MAX_LINES = 400
# Lower layers never import higher ones; a module may import its own layer's (no cycle, below).
LAYERS = (
    {"xla_fp4.config", "xla_fp4.state", "xla_fp4.notice", "xla_fp4.report"},
    {"xla_fp4.numerics"},
    {"xla_fp4.kernels", "xla_fp4.telemetry"},
    {"xla_fp4.sharding"},
    {"xla_fp4.passes"},
    {"xla_fp4.hook"},
    {"xla_fp4", "xla_fp4.api", "xla_fp4._plugin", "xla_fp4.__main__"},
)


def _modules():
  out = {}
  for path in PACKAGE.rglob("*.py"):
    name = ".".join(("xla_fp4",) + path.relative_to(PACKAGE).with_suffix("").parts)
    out[name.removesuffix(".__init__")] = path
  return out


def _imports(modules):
  """{module: {the xla_fp4 modules it imports, at any depth of its code}} (compiled extensions left out)."""
  def resolve(name):
    while name not in modules:
      name = name.rpartition(".")[0]
    return name
  graph = {}
  for name, path in modules.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "xla_fp4":
        for alias in node.names:
          if not alias.name.startswith("_xla_fp4"):
            full = f"{node.module}.{alias.name}"
            found.add(full if full in modules else resolve(node.module))
      elif isinstance(node, ast.Import):
        found |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "xla_fp4"}
    graph[name] = found - {name}
  return graph


def _layer(module):
  best = None
  for i, layer in enumerate(LAYERS):
    for prefix in layer:
      if module == prefix or module.startswith(prefix + ".") and prefix != "xla_fp4":
        if best is None or len(prefix) > best[1]:
          best = (i, len(prefix))
  assert best is not None, f"{module} is in no layer of tests/test_architecture.py"
  return best[0]


def test_no_module_is_over_400_lines():
  long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
  assert not long, long


def test_imports_run_downward():
  upward = [(a, b) for a, bs in _imports(_modules()).items() for b in bs if _layer(b) > _layer(a)]
  assert not upward, upward


def test_no_import_cycle():
  graph = _imports(_modules())
  state, cycles = {}, []

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        cycles.append(path[path.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = "done"
  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  assert not cycles, cycles


def test_the_rewrite_reads_the_analysis_through_its_records_only():
  graph = _imports(_modules())
  reads = {(a, b) for a, bs in graph.items() if a.startswith("xla_fp4.passes.rewrite")
           for b in bs if b.startswith("xla_fp4.passes.analysis")}
  assert reads and {b for _, b in reads} == {"xla_fp4.passes.analysis.records"}, reads


def test_the_cost_model_names_no_target():
  """sharding/cost.py finds the GEMMs and quantizers from the records (Target.counts_as_dot, Target.quantizes)."""
  text = (PACKAGE / "sharding" / "cost.py").read_text()
  named = [t.name for t in targets.ALL if t.name in text]
  constants = [name for name in dir(targets) if name.isupper() and isinstance(getattr(targets, name), targets.Target)
               and f"targets.{name}" in text]
  assert not named and not constants, (named, constants)
