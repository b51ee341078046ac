"""The package floors of docs/architecture.md, checked on the source: a module imports only from floors below
its own (its own package aside), and no function-local `from tlt` import dodges a cycle outside the CLI's lazy
start-up imports."""

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "tlt"

# floor of each top-level module or package of src/tlt (docs/architecture.md, "Packages")
FLOORS = {"__init__": 0, "errors": 0,
          "files": 0.5, "threads": 0.5,  # helpers every floor uses (atomic writes, thread budgets); they raise errors
          "interrupts": 0.5,  # signals held over a block that must complete (a step's checkpoint)
          "device_values": 0.5,  # metrics read from the device at once
          "capture_lock": 0.5,  # one CUDA-graph capture at a time (rollout/graph_runner, drafter/step_graph)
          "models": 1,
          "sampling": 2, "optimizer_state": 2, "lr_schedule": 2,
          "speculative": 3,
          "rollout": 4,
          "drafter": 5, "tasks": 5, "metrics": 5,
          "rl": 6,
          "distributed": 7,
          "report": 8, "verify": 8, "generate_cli": 8,
          "verify_cli": 8.5,  # tlt verify's command: the check (verify) with generate's sampling flags
          "cli": 9}
LAZY_IMPORTERS = {"cli", "generate_cli", "verify_cli"}  # start-up time: a command imports only what it runs


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _tlt_imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tlt":
            yield node, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tlt":
                    yield node, alias.name


def _modules():
    for path in sorted(SOURCE.rglob("*.py")):
        relative = path.relative_to(SOURCE.parent).with_suffix("")
        yield path, _unit(".".join(relative.parts)), ast.parse(path.read_text(encoding="utf-8"))


def test_every_module_has_a_floor():
    assert {unit for _, unit, _ in _modules()} == set(FLOORS)


def test_imports_go_only_to_lower_floors():
    upward = [f"{path.relative_to(SOURCE)} imports {name} (floor {FLOORS[_unit(name)]} >= {FLOORS[unit]})"
              for path, unit, tree in _modules() for _, name in _tlt_imports(tree)
              if _unit(name) != unit and FLOORS[_unit(name)] >= FLOORS[unit]]
    assert upward == []


def test_no_function_local_tlt_import_outside_the_cli():
    local = [f"{path.relative_to(SOURCE)}:{node.lineno} {name}"
             for path, unit, tree in _modules() if unit not in LAZY_IMPORTERS
             for function in ast.walk(tree) if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node, name in _tlt_imports(function)]
    assert local == []
