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

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "vllm_actors"
ACTORS = PACKAGE / "actors"

# Whole folders of state machines, and single state-machine modules of folders that also hold I/O code.
STATE_MACHINE_FOLDERS = ("scheduler", "kv_cache_manager", "metrics_store", "controller", "worker")
STATE_MACHINE_FILES = ("frontend/frontend.py", "frontend/detokenizer.py")
# The worker's state machine works on torch tensors (the GPU engine itself is vllm_actors/runner).
TORCH_ALLOWED = {f"vllm_actors.actors.worker.{name}" for name in (
    "worker", "step_data", "engine", "batch", "host_copies", "logprobs", "ranks", "uploads", "draw", "draft_model",
    "eagle3", "kv_rejoin", "spec_overlap", "overlap_steps")}
# Folders whose modules import one another without a circle (``from X import`` inside functions
# and under TYPE_CHECKING counts too).
# Every actor folder; not yet runtime/ (the supervisor and the Ray launcher import each other lazily)
# nor kernels/ (attention.py picks its Triton backend with a lazy import of the module that uses it).
CYCLE_FREE_FOLDERS = (*(path for path in sorted(ACTORS.iterdir()) if (path / "__init__.py").exists()),
                      ACTORS / "scheduler" / "policies", PACKAGE / "runner", PACKAGE / "clients",
                      PACKAGE / "server", PACKAGE / "protocol", PACKAGE / "models", PACKAGE / "envs")

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


def test_the_offline_llm_and_the_server_import_no_torch() -> None:
    """The clients' processes (LLM in a script, ``serve``, the CLI) leave torch to the workers: it is
    about 1.5 s of CPU in every one of them (an adapter's check reads only its header)."""
    code = ("import sys\nimport vllm_actors.llm, vllm_actors.server.serve, vllm_actors.cli\n"
            "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]"


# Settings are read from the environment through vllm_actors.envs alone (one registry, documented in
# docs/settings.md). Writing the environment, or building a child process's from it, is allowed.
ENVS_PACKAGE = PACKAGE / "envs"
# Files whose owners convert their reads after the merge (the list is then emptied).
ENV_READS_NOT_YET_CONVERTED: tuple[str, ...] = ()
_ENV_WRITES = frozenset({"setdefault", "update", "pop", "copy", "clear"})  # os.environ.<these>(...)


def _writes_or_copies(node: ast.Attribute, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether this ``os.environ`` is written (``[k] = v``, ``del``, ``.update``...) or copied for a child."""
    parent = parents[node]
    if isinstance(parent, ast.Subscript):
        return isinstance(parent.ctx, (ast.Store, ast.Del))
    if isinstance(parent, ast.Attribute):
        return parent.attr in _ENV_WRITES
    if isinstance(parent, ast.Call):  # dict(os.environ, NAME=...)
        return isinstance(parent.func, ast.Name) and parent.func.id == "dict" and node in parent.args
    if isinstance(parent, ast.Dict):  # {**os.environ, NAME: ...}
        return any(key is None and value is node for key, value in zip(parent.keys, parent.values, strict=True))
    return False


def environment_reads(path: Path, root: Path = PACKAGE) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    where = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{where}:{node.lineno} imports os.{a.name}" for a in node.names
                      if a.name in ("environ", "environb", "getenv", "getenvb")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr in ("getenv", "getenvb", "environb") or (
                    node.attr == "environ" and not _writes_or_copies(node, parents)):
                found.append(f"{where}:{node.lineno} reads os.{node.attr}")
    return found


def test_settings_are_read_from_the_environment_only_through_envs() -> None:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if path.is_relative_to(ENVS_PACKAGE) or where.startswith(ENV_READS_NOT_YET_CONVERTED):
            continue
        problems += environment_reads(path)
    print("\n".join(problems))
    assert not problems, ("read settings through vllm_actors.envs (declare new ones there):\n  "
                          + "\n  ".join(problems))


def test_the_environment_rule_tells_reads_from_writes(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom os import getenv\n"
                      "a = os.environ.get('X')\nb = os.environ['X']\nc = os.getenv('X')\nf(os.environ)\n"
                      "os.environ['X'] = '1'\nos.environ.setdefault('X', '1')\nos.environ.pop('X', None)\n"
                      "env = dict(os.environ, X='1')\nenv = {**os.environ, 'X': '1'}\ndel os.environ['X']\n")
    lines = sorted(problem.split(":")[1].split()[0] for problem in environment_reads(sample, tmp_path))
    assert lines == ["2", "3", "4", "5", "6"], lines


def folder_imports(folder: Path) -> dict[str, set[str]]:
    """Each module of ``folder`` -> the modules of the same folder it imports."""
    modules = {module_name(path): path for path in sorted(folder.glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # ``from pkg.mod import x`` reads as pkg.mod.x: the module is the name or its parent.
        graph[name] = {candidate for _, imported in imports(path)
                       for candidate in (imported, imported.rpartition(".")[0])
                       if candidate in modules and candidate != name}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports (its modules, the first repeated at the end), or [] when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str]:
        if name in path:
            return [*path[path.index(name):], name]
        if name in done:
            return []
        path.append(name)
        for target in sorted(graph.get(name, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(name)
        return []

    for name in sorted(graph):
        cycle = visit(name)
        if cycle:
            return cycle
    return []


def test_the_cycle_check_finds_a_circle() -> None:
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("folder", CYCLE_FREE_FOLDERS, ids=lambda folder: folder.relative_to(PACKAGE).as_posix())
def test_no_import_cycle_inside_a_folder(folder: Path) -> None:
    cycle = import_cycle(folder_imports(folder))
    assert not cycle, "import circle: " + " -> ".join(cycle)


# Modules that peers probe by top-level name (transformers imports `kernels` to see whether the Hub's kernels
# package is there): a benchmark script's folder is first on sys.path in its peer processes, so a module of that
# name there breaks vLLM's start (it did: benchmarks/lib/kernels.py).
PROBED_BY_PEERS = ("kernels", "vllm", "sglang", "transformers", "torch", "triton", "flashinfer", "flash_attn")


def test_no_benchmark_module_shadows_a_package_peers_import() -> None:
    for folder in (ROOT / "benchmarks", ROOT / "benchmarks" / "lib"):
        names = {path.stem for path in folder.glob("*.py")} | {path.name for path in folder.iterdir() if path.is_dir()}
        shadowing = sorted(names & set(PROBED_BY_PEERS))
        assert not shadowing, f"{folder}: {shadowing} would shadow the package of that name in peer processes"
