"""Layering rules of the source tree, checked on the source text (ast) and in a fresh interpreter.

State machines are pure: a state-machine module may import only

* ``vllm_actors.protocol.*``,
* its own actor's folder, ``vllm_actors.actors.<actor>.*``,
* plain libraries (the standard library, msgspec, numpy, ...) except those that do I/O, keep time,
  log or run threads (``FORBIDDEN``); torch only in the worker's state machine.

Every import statement in the module counts: module level, inside functions, and inside
``if TYPE_CHECKING:`` blocks. TYPE_CHECKING imports get no exemption of their own: the ones a
state machine needs (types from its own folder or from protocol/) are allowed anyway, and a
type-only import of another part of the project would still tie the state machine's interface to it.
Relative imports are resolved against the module's package before they are judged.

The protocol package imports nothing of the project but itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "vllm_actors"
ACTORS = PACKAGE / "actors"

# Whole folders of state machines, and single state-machine modules of folders that also hold I/O code.
STATE_MACHINE_FOLDERS = ("scheduler", "kv_cache_manager", "metrics_store", "controller")
STATE_MACHINE_FILES = ("frontend/frontend.py", "frontend/detokenizer.py", "worker/worker.py")
TORCH_ALLOWED = {"vllm_actors.actors.worker.worker"}

# Top-level modules a state machine must not import: sockets, clocks, processes, threads, logging, event loops.
FORBIDDEN = frozenset({
    "zmq", "socket", "time", "os", "threading", "logging", "structlog", "subprocess",
    "asyncio", "multiprocessing", "concurrent", "signal", "select", "selectors", "datetime",
    "shutil", "tempfile", "http", "urllib", "socketserver",
})


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def state_machine_modules() -> list[Path]:
    paths = [path for folder in STATE_MACHINE_FOLDERS for path in sorted((ACTORS / folder).glob("*.py"))]
    return paths + [ACTORS / name for name in STATE_MACHINE_FILES]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported name) for every import in the file; ``from X import a`` gives ``X.a`` for project
    modules (``a`` may be a submodule) and ``X`` for everything else."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base == "__future__":
                continue
            if base == "vllm_actors" or base.startswith("vllm_actors."):
                found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
            else:
                found.append((node.lineno, base))
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def state_machine_violations(path: Path) -> list[str]:
    name = module_name(path)
    own_folder = ".".join(name.split(".")[:3])  # vllm_actors.actors.<actor>
    problems = []
    for line, imported in imports(path):
        top = imported.split(".")[0]
        if top == "vllm_actors":
            # ``from vllm_actors.protocol.events import Arrived`` reads as vllm_actors.protocol.events.Arrived.
            if not (within(imported, "vllm_actors.protocol") or within(imported, own_folder)):
                problems.append(f"{name}:{line} imports {imported} (outside protocol/ and its own folder)")
        elif top == "torch" and name not in TORCH_ALLOWED:
            problems.append(f"{name}:{line} imports {imported} (torch is for the worker only)")
        elif top in FORBIDDEN:
            problems.append(f"{name}:{line} imports {imported} (I/O, clock, logging or threads)")
    return problems


def test_state_machines_import_only_protocol_their_own_folder_and_plain_libraries() -> None:
    modules = state_machine_modules()
    assert all(path.is_file() for path in modules), [str(path) for path in modules if not path.is_file()]
    problems = [problem for path in modules for problem in state_machine_violations(path)]
    print("\n".join(problems))
    assert not problems, "state machines must be pure:\n  " + "\n  ".join(problems)


def test_protocol_imports_nothing_of_the_project_but_itself() -> None:
    problems = []
    for path in sorted((PACKAGE / "protocol").glob("*.py")):
        for line, imported in imports(path):
            if within(imported, "vllm_actors") and not within(imported, "vllm_actors.protocol"):
                problems.append(f"{module_name(path)}:{line} imports {imported}")
    print("\n".join(problems))
    assert not problems, "protocol/ must not import the rest of the project:\n  " + "\n  ".join(problems)


def test_importing_the_bookkeeping_state_machines_and_the_protocol_does_not_import_torch() -> None:
    paths = [*state_machine_modules(), *sorted((PACKAGE / "protocol").glob("*.py"))]
    modules = [module_name(path) for path in paths if path.name not in ("__init__.py", "__main__.py")]
    modules = [name for name in modules if name not in TORCH_ALLOWED]
    # Import one module at a time and report the first that brings torch in.
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(name)\n"
        "        break\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"importing {result.stdout.strip()} imports torch"
