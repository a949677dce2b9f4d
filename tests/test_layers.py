"""Imports run one way: from the loop to the parts to the foundations.

Every module under mcore_rl/ is read with `ast` (module-level, function-local and TYPE_CHECKING imports alike),
each import of the package's own code is mapped to its unit (a folder such as `megatron/`, or a top-level module
such as `batch.py`), and the units are checked against LAYERS: a unit imports only units of its own layer or of
a lower one, and no two units import each other, directly or around a cycle. A new folder or top-level module
must be placed in LAYERS (the test names it). The checker is also run on small packages written here, to show it
catches an upward import and a cycle.

The pre-flight package is also imported in a fresh interpreter: it must load no Megatron, vLLM, transformers or
torch, so `mcore-rl check` / `plan` stay fast and the engines and the actor can build on it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "mcore_rl"

# Lowest first. A unit may import its own layer and the layers above it in this list, never one below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundations", ("__init__", "compat", "ports", "platform", "typed_yaml", "algo_config", "config", "safety")),
    ("foundations: processes, metrics", ("supervise", "metrics")),
    ("pre-flight and run files", ("preflight", "run_dir")),
    ("plain-torch parts", ("data", "rewards", "algos")),
    ("step data", ("batch",)),
    ("models", ("models",)),
    ("weight sync", ("weight_sync",)),
    ("engines", ("rollout",)),
    ("actor", ("megatron",)),
    ("one step", ("step_data", "dynamic_sampling", "colocation", "generation", "placement", "separate", "streaming")),
    ("loop", ("trainer", "plot")),
    ("entry points", ("cli", "convert", "from_verl", "torchrun", "multinode")),
]


def unit_of(module: str) -> str:
    """`mcore_rl.megatron.actor` -> `megatron`, `mcore_rl.batch` -> `batch`, `mcore_rl` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, module: str, package: str) -> list[tuple[str, int]]:
    """(imported module of `package`, line) for every import statement in the file, at any depth."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            if base == package:  # `from mcore_rl import support`: the names are the modules
                found += [(f"{package}.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((base, node.lineno))
    return [(name, line) for name, line in found if name == package or name.startswith(package + ".")]


def unit_imports(root: Path) -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> where ("file:line"), over every module under `root`."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        for target, line in imported_modules(path, module, root.name):
            source, imported = unit_of(module), unit_of(target)
            if source != imported:
                edges.setdefault((source, imported), []).append(f"{path.relative_to(root.parent)}:{line}")
    return edges


def units(root: Path) -> set[str]:
    return {unit_of(module_name(path, root)) for path in root.rglob("*.py")}


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Each cycle between units once, as the path around it (depth-first search over the unit graph)."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    found, seen_sets, done = [], set(), set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            loop = path[path.index(node) :]
            if frozenset(loop) not in seen_sets:
                seen_sets.add(frozenset(loop))
                found.append(loop + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for start in sorted(graph):
        visit(start, [])
    return found


def layer_problems(root: Path, layers: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Every unplaced unit, upward import and cycle under `root`, one line each (empty: the layers hold)."""
    rank = {unit: i for i, (_, members) in enumerate(layers) for unit in members}
    name = {unit: layer for layer, members in layers for unit in members}
    problems = [
        f"{unit} is in no layer: add it to LAYERS in tests/test_layers.py" for unit in sorted(units(root) - set(rank))
    ]
    edges = unit_imports(root)
    for (source, target), where in sorted(edges.items()):
        if source in rank and target in rank and rank[target] > rank[source]:
            problems.append(
                f"upward import: {source} ({name[source]}) imports {target} ({name[target]}) at {', '.join(where)}"
            )
    for loop in cycles(edges):
        steps = [f"{a} -> {b} ({edges[(a, b)][0]})" for a, b in zip(loop, loop[1:])]
        problems.append("cycle: " + ", ".join(steps))
    return problems


def test_imports_run_downward_between_units():
    problems = layer_problems(REPO / PACKAGE, LAYERS)
    assert not problems, "\n".join(problems)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


SMALL_LAYERS = [("low", ("base", "__init__")), ("middle", ("parts",)), ("high", ("loop",))]


def test_checker_accepts_downward_imports(tmp_path):
    pkg = _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "base.py": "X = 1\n",
            "parts/__init__.py": "from pkg.base import X\n",
            "parts/a.py": "from . import b\n",
            "parts/b.py": "from ..base import X\n",
            "loop.py": "import pkg.parts.a\n\ndef f():\n    from pkg import base\n",
        },
    )
    assert layer_problems(pkg, SMALL_LAYERS) == []


def test_checker_finds_an_upward_import_inside_a_function(tmp_path):
    pkg = _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "base.py": "def f():\n    from pkg.parts.a import Y\n",
            "parts/__init__.py": "",
            "parts/a.py": "Y = 1\n",
            "loop.py": "",
        },
    )
    assert layer_problems(pkg, SMALL_LAYERS) == ["upward import: base (low) imports parts (middle) at pkg/base.py:2"]


def test_checker_finds_a_cycle_and_an_unplaced_unit(tmp_path):
    layers = [("low", ("__init__",)), ("parts", ("models", "engines"))]
    pkg = _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "models/__init__.py": "from pkg import engines\n",
            "engines/__init__.py": "",
            "engines/run.py": "from .. import models\n",
            "extra.py": "",
        },
    )
    assert layer_problems(pkg, layers) == [
        "extra is in no layer: add it to LAYERS in tests/test_layers.py",
        "cycle: engines -> models (pkg/engines/run.py:1), models -> engines (pkg/models/__init__.py:1)",
    ]


def test_preflight_loads_no_megatron_vllm_transformers_or_torch():
    modules = sorted(p.stem for p in (REPO / PACKAGE / "preflight").glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module('mcore_rl.preflight.' + m)\n"
        "heavy = ('megatron', 'vllm', 'vllm_ascend', 'transformers', 'torch', 'torch_npu', 'mbridge')\n"
        "print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] in heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert "layout" in modules and "memory_plan" in modules
    assert json.loads(out.stdout) == []
