"""The package's import graph, read from the source: no cycle and no upward import (docs/reference/design.md,
Layout), and the attention wing's layering (lm/attention/__init__.py's docstring)."""

import ast
import graphlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Each package and the packages it may import besides itself: launch → lm → data_pipelines, eval → lm.
ALLOWED = {
    "launch": {"lm", "data_pipelines"},
    "eval": {"lm", "data_pipelines"},
    "lm": {"data_pipelines"},
    "data_pipelines": set(),
    "configs": {"lm", "data_pipelines"}
}
# Every module of the attention wing but the public entry, the definition and the decoding states is a
# kernel, and may import only the definition.
KERNELS = tuple(f"lm.attention.{p.stem}" for p in sorted((ROOT / "lm" / "attention").glob("*.py"))
                if p.stem not in ("__init__", "core", "decode_cache"))


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
  """Module → the modules of ours it imports anywhere in its source (functions included)."""
  modules = {
      ".".join(p.relative_to(root).with_suffix("").parts): p for package in ALLOWED
      for p in (root / package).rglob("*.py")
  }
  modules = {m.removesuffix(".__init__"): p for m, p in modules.items()}
  graph = {}
  for module, path in modules.items():
    graph[module] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        # `from lm import model` imports the module lm.model; `from lm.model import X`, lm.model.
        names = [
            f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
            for a in node.names
        ]
      else:
        continue
      graph[module] |= {n for n in names if n in modules and n != module}
  return graph


def problems(graph: dict[str, set[str]]) -> list[str]:
  """Upward imports and import cycles, as readable lines."""

  def rule(package):
    allowed = sorted(ALLOWED[package])
    return f"{package} may import only {', '.join(allowed)}" if allowed else f"{package} imports nothing"

  found = [
      f"{m} imports {t}: {rule(m.split('.')[0])} of ours" for m, targets in sorted(graph.items())
      for t in sorted(targets) if t.split(".")[0] not in ALLOWED[m.split(".")[0]] | {m.split(".")[0]}
  ]
  try:
    graphlib.TopologicalSorter(graph).prepare()
  except graphlib.CycleError as e:
    found.append(f"import cycle: {' -> '.join(e.args[1])}")
  return found


def test_no_upward_import_and_no_cycle():
  graph = import_graph(ROOT)
  assert {"lm.attention", "lm.model", "eval.latent", "launch.aot.compile",
          "data_pipelines.sraven"} <= set(graph)
  assert not problems(graph), "\n".join(problems(graph))


def test_attention_kernels_import_only_the_core():
  graph = import_graph(ROOT)
  assert graph["lm.attention.core"] == set()
  for kernel in KERNELS:
    assert graph[kernel] <= {"lm.attention.core"}, (kernel, graph[kernel])
  assert set(KERNELS) | {"lm.attention.core"} <= graph["lm.attention"]
  assert "lm.attention.hypernetwork" in KERNELS


def test_runtime_and_attention_stay_below_the_model():
  """lm/runtime/ (what surrounds a run) and lm/attention/ import neither the model nor the training
  step: the model imports them, never the reverse."""
  graph = import_graph(ROOT)
  for module, targets in graph.items():
    ours = {t for t in targets if t.startswith("lm.")}
    if module.startswith("lm.runtime"):
      assert ours <= {t for t in graph if t.startswith("lm.runtime")}, (module, ours)
    if module.startswith("lm.attention"):
      assert ours <= {t for t in graph if t.startswith("lm.attention")} | {"lm.sharding"}, (module, ours)


def outside_imports(root: pathlib.Path) -> dict[str, set[str]]:
  """Module of ours → the top-level packages not of ours it imports anywhere in its source."""
  found = {}
  for package in ALLOWED:
    for path in (root / package).rglob("*.py"):
      module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
      found[module] = set()
      for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
          found[module] |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
          found[module].add(node.module.split(".")[0])
  return {m: names - set(ALLOWED) for m, names in found.items()}


def test_only_the_prepare_step_imports_seqio_and_tensorflow():
  """seqio and TensorFlow (the seqio extra) are imported by its two modules alone, and of ours only
  lm-prepare imports those: training, evaluation and the other commands never reach them."""
  graph, outside = import_graph(ROOT), outside_imports(ROOT)
  heavy = {m for m, names in outside.items() if names & {"seqio", "tensorflow", "tensorflow_text"}}
  assert heavy == {"data_pipelines.seqio_prepare", "data_pipelines.seqio_tasks"}
  assert {m for m, targets in graph.items() if targets & heavy} - heavy == {"launch.prepare"}
  reached, todo = set(), [m for m in graph if m != "launch.prepare" and m not in heavy]
  while todo:
    module = todo.pop()
    if module not in reached:
      reached.add(module)
      todo += graph[module]
  assert not reached & heavy, reached & heavy


def test_the_check_finds_a_cycle_and_an_upward_import(tmp_path):
  for package in ALLOWED:
    (tmp_path / package).mkdir()
  (tmp_path / "lm" / "a.py").write_text("from lm import b\n")
  (tmp_path / "lm" / "b.py").write_text("def f():\n  import lm.a\n")
  (tmp_path / "data_pipelines" / "c.py").write_text("from lm.a import thing\n")
  found = problems(import_graph(tmp_path))
  assert "data_pipelines.c imports lm.a: data_pipelines imports nothing of ours" in found
  assert any(line.startswith("import cycle: ") and "lm.a" in line and "lm.b" in line for line in found)
