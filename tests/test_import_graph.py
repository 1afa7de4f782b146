"""The import graph of engine/, graphs/ and appliance/: no cycle, no upward arrow, no torch in core.

Every `import` and `from ... import` of every module is read with `ast`, wherever it sits
(module level, inside functions, under `if TYPE_CHECKING:`): a lazy import is still an
arrow a reader has to follow. Relative imports are resolved; `from pkg import name` points at
`pkg.name` when that is a module, else at `pkg` itself.

The layering (arrows point down only):

    appliance (http, grpc, config, cli, ...)        may import anything below
    engine entry points (llm, llm_engine, async_engine, request_stream, beam_search, ...)
    engine.worker        engine.output              not each other; worker may use graphs
    engine.core                                     torch-free
    engine.config  engine.sampling_params           import only engine.errors
    engine.pooling_params  engine.lora_request     (the same: leaves)
    engine.errors                                   imports nothing of ours
    graphs                                          imports nothing from engine or appliance

The checker takes any source root, so its own tests below run it on small fake trees, one
with a cycle and an upward arrow, to show that it can fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "graphs", "appliance")
LEAVES = frozenset(
    {
        "engine.config",
        "engine.errors",
        "engine.sampling_params",
        "engine.pooling_params",
        "engine.lora_request",
    }
)
BASE = "engine.errors"  # the one module the other leaves may import
CORE = "engine.core"
LAYERED_TOP_LEVEL = frozenset({"engine", "appliance"})
# Not importable by engine.core, directly or through the modules it imports.
TORCH_LIKE = frozenset({"torch", "transformers"})


# ---- the graph --------------------------------------------------------------------------------
@dataclass
class ImportGraph:
    """Modules by dotted name; `edges[src][dst]` is the first line where src imports dst."""

    root: Path
    files: dict[str, Path] = field(default_factory=dict)
    packages: set[str] = field(default_factory=set)  # modules that are a package's __init__
    edges: dict[str, dict[str, int]] = field(default_factory=dict)
    external: dict[str, dict[str, int]] = field(default_factory=dict)  # top-level names
    missing: list[str] = field(default_factory=list)  # imports of our modules that don't exist

    def where(self, src: str, dst: str | None = None, line: int | None = None) -> str:
        """`path:line` of src's import of dst (or of `line`)."""
        if dst is not None:
            line = self.edges[src].get(dst) or self.external[src].get(dst)
        return f"{self.files[src].relative_to(self.root).as_posix()}:{line}"


def discover(root: Path, packages: Iterable[str] = PACKAGES) -> ImportGraph:
    """Every .py file under root/<package> as a module named by its path."""
    graph = ImportGraph(root)
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
                graph.packages.add(".".join(parts))
            graph.files[".".join(parts)] = path
    ours = {name.split(".")[0] for name in graph.files}
    for name, path in graph.files.items():
        graph.edges[name], graph.external[name] = {}, {}
        for target, fallback, line in _imports(name, path, name in graph.packages):
            _add_edge(graph, ours, name, target, fallback, line)
    return graph


def _imports(module: str, path: Path, is_package: bool) -> Iterable[tuple[str, str | None, int]]:
    """(target, fallback, line) of every import in the file.

    `import a.b` is ("a.b", None); `from a import b` is ("a.b", "a"): the module a.b if there
    is one, else the name b of module a.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package, level - 1 times
                parts = here.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [base])])
            for alias in node.names:
                yield f"{base}.{alias.name}", base, node.lineno


def _add_edge(
    graph: ImportGraph, ours: set[str], src: str, target: str, fallback: str | None, line: int
) -> None:
    top = target.split(".")[0]
    if top not in ours:
        graph.external[src][top] = min(line, graph.external[src].get(top, line))
        return
    if target in graph.files:
        dst = target
    elif fallback is not None and fallback in graph.files:
        dst = fallback
    else:
        graph.missing.append(f"{graph.where(src, line=line)} imports {fallback or target}")
        return
    if dst != src:
        graph.edges[src][dst] = min(line, graph.edges[src].get(dst, line))


# ---- what is checked --------------------------------------------------------------------------
def group_of(module: str, graph: ImportGraph) -> str:
    """The package-level node: a subpackage as a whole (engine.core, engine.worker,
    engine.output, appliance.http, appliance.grpc, ...); in engine and appliance, whose
    top-level modules sit on different layers, each of those on its own (the entry points,
    the leaves, appliance's cli and metrics); any other package as a whole (graphs)."""
    parts = module.split(".")
    sub = ".".join(parts[:2])
    if len(parts) >= 2 and sub in graph.packages:
        return sub
    return module if parts[0] in LAYERED_TOP_LEVEL else parts[0]


def strongly_connected(nodes: Iterable[str], edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's SCCs with more than one member (iterative: no recursion limit to hit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    scc.add(member)
                    if member == node:
                        break
                if len(scc) > 1:
                    found.append(scc)
    return found


def module_cycles(graph: ImportGraph) -> list[str]:
    out = []
    edges = {m: set(d) for m, d in graph.edges.items()}
    for scc in strongly_connected(sorted(graph.files), edges):
        arrows = [
            f"    {s} -> {d} ({graph.where(s, d)})"
            for s in sorted(scc)
            for d in sorted(graph.edges[s])
            if d in scc
        ]
        out.append(f"import cycle between {sorted(scc)}:\n" + "\n".join(arrows))
    return out


def package_cycles(graph: ImportGraph) -> list[str]:
    edges: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], str] = {}
    for src, dsts in graph.edges.items():
        for dst in dsts:
            gs, gd = group_of(src, graph), group_of(dst, graph)
            if gs != gd:
                edges.setdefault(gs, set()).add(gd)
                witness.setdefault((gs, gd), f"{src} -> {dst} ({graph.where(src, dst)})")
    out = []
    for scc in strongly_connected(sorted(edges), edges):
        arrows = [
            f"    {witness[(s, d)]}" for s in sorted(scc) for d in sorted(edges[s]) if d in scc
        ]
        out.append(f"package cycle between {sorted(scc)}, e.g.:\n" + "\n".join(arrows))
    return out


def upward_reason(src: str, dst: str, graph: ImportGraph) -> str | None:
    """Why src must not import dst, or None when the arrow points down (or sideways inside)."""
    gs, gd = group_of(src, graph), group_of(dst, graph)
    top_s, top_d = src.split(".")[0], dst.split(".")[0]
    if gs == gd:
        return None
    if src == BASE:
        return f"{src} is the base: it imports nothing of ours"
    if src in LEAVES and dst != BASE:
        return f"{src} imports only {BASE} of ours"
    if gs == CORE and gd not in LEAVES:
        return "engine.core imports only engine.core and the leaves (config, errors, params)"
    if gs in ("engine.worker", "engine.output") and top_d == "engine":
        if gd not in {CORE, *LEAVES}:
            return f"{gs} imports only itself, engine.core and the leaves (not {gd})"
    if top_s == "graphs" and top_d in ("engine", "appliance"):
        return "graphs is a leaf package: it imports nothing from engine or appliance"
    if top_s == "engine" and top_d == "appliance":
        return "engine never imports appliance"
    return None


def upward_arrows(graph: ImportGraph) -> list[str]:
    out = []
    for src in sorted(graph.edges):
        for dst in sorted(graph.edges[src]):
            reason = upward_reason(src, dst, graph)
            if reason:
                out.append(f"{src} -> {dst} ({graph.where(src, dst)}): {reason}")
    return out


def torch_in_core(graph: ImportGraph) -> list[str]:
    """Core modules that reach torch (or transformers), with the chain of imports that does."""
    out = []
    for start in sorted(m for m in graph.files if group_of(m, graph) == CORE):
        parent = {start: None}
        queue = [start]
        while queue:
            mod = queue.pop(0)
            banned = sorted(TORCH_LIKE & set(graph.external[mod]))
            if banned:
                chain = [mod]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                route = " -> ".join(reversed(chain))
                out.append(
                    f"{start} imports {banned[0]} via {route} ({graph.where(mod, banned[0])})"
                )
                break
            for dst in sorted(graph.edges[mod]):
                if dst not in parent:
                    parent[dst] = mod
                    queue.append(dst)
    return out


def _fail_on(problems: list[str], what: str) -> None:
    assert not problems, f"{len(problems)} {what}:\n" + "\n".join(problems)


# ---- the repository ---------------------------------------------------------------------------
def _repo_graph() -> ImportGraph:
    return discover(ROOT)


def test_every_import_of_ours_names_a_module_that_exists():
    _fail_on(_repo_graph().missing, "imports of missing modules")


def test_no_import_cycle_between_modules():
    _fail_on(module_cycles(_repo_graph()), "module cycles")


def test_no_import_cycle_between_packages():
    _fail_on(package_cycles(_repo_graph()), "package cycles")


def test_every_arrow_points_down_the_layers():
    _fail_on(upward_arrows(_repo_graph()), "upward imports")


def test_engine_core_never_reaches_torch():
    _fail_on(torch_in_core(_repo_graph()), "torch imports under engine/core")


# ---- the checker itself, on fake trees --------------------------------------------------------
def _tree(root: Path, files: dict[str, str]) -> ImportGraph:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return discover(root)


FAKE = {
    "engine/__init__.py": "",
    "engine/config.py": "",
    "engine/core/__init__.py": "",
    "engine/core/request.py": "from engine.config import X\nfrom .scheduler import S\n",
    # A cycle (a relative import back, under TYPE_CHECKING), an upward arrow (in a function)
    # and torch through another core module.
    "engine/core/scheduler.py": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import request\n"
        "def run():\n    from engine.worker.runner import ModelRunner\n"
        "from engine.core import tensors\n"
    ),
    "engine/core/tensors.py": "import torch.nn\n",
    # worker and output import each other without a module cycle: a package cycle only.
    "engine/worker/__init__.py": "",
    "engine/worker/runner.py": "import graphs.buckets\n",
    "engine/worker/util.py": "from engine.output import processor\n",
    "engine/output/__init__.py": "",
    "engine/output/processor.py": "from engine.worker import runner\n",
    "graphs/__init__.py": "",
    "graphs/buckets.py": "import torch\nfrom engine.config import X\n",
    "appliance/__init__.py": "",
    "appliance/cli.py": "from engine.llm import LLM\n",  # no such module
}


def test_checker_resolves_relative_lazy_and_type_checking_imports(tmp_path):
    g = _tree(tmp_path, FAKE)
    assert g.edges["engine.core.request"] == {"engine.config": 1, "engine.core.scheduler": 2}
    assert g.edges["engine.core.scheduler"] == {
        "engine.core.request": 3,
        "engine.worker.runner": 5,
        "engine.core.tensors": 6,
    }
    assert g.edges["engine.output.processor"] == {"engine.worker.runner": 1}
    assert g.external["engine.core.tensors"] == {"torch": 1}
    assert g.missing == ["appliance/cli.py:1 imports engine.llm"]


def test_checker_finds_cycles_upward_arrows_and_torch_in_core(tmp_path):
    g = _tree(tmp_path, FAKE)
    pair = frozenset({"engine.core.request", "engine.core.scheduler"})
    [cycle] = module_cycles(g)
    assert cycle.startswith(f"import cycle between {sorted(pair)}")
    assert "engine.core.scheduler -> engine.core.request (engine/core/scheduler.py:3)" in cycle
    [packages] = package_cycles(g)
    assert packages.startswith("package cycle between ['engine.output', 'engine.worker']")
    up = upward_arrows(g)
    assert [a.split(" (")[0] for a in up] == [
        "engine.core.scheduler -> engine.worker.runner",
        "engine.output.processor -> engine.worker.runner",
        "engine.worker.util -> engine.output.processor",
        "graphs.buckets -> engine.config",
    ]
    assert "(engine/core/scheduler.py:5): engine.core imports only" in up[0]
    found = torch_in_core(g)
    assert len(found) == 3  # request and scheduler through tensors, and tensors itself
    assert found[0] == (
        "engine.core.request imports torch via engine.core.request -> engine.core.scheduler"
        " -> engine.core.tensors (engine/core/tensors.py:1)"
    )


def test_checker_passes_a_clean_tree(tmp_path):
    g = _tree(tmp_path, {
        "engine/__init__.py": "from engine.sampling_params import P\n",
        "engine/sampling_params.py": "",
        "engine/core/__init__.py": "",
        "engine/core/request.py": "from ..sampling_params import P\n",
        "engine/worker/__init__.py": "",
        "engine/worker/runner.py": "import torch\nfrom engine.core.request import R\nimport graphs.x\n",
        "engine/llm.py": "from engine.worker.runner import M\nfrom engine.core import request\n",
        "graphs/__init__.py": "",
        "graphs/x.py": "import torch\n",
    })  # fmt: skip
    assert (g.missing, module_cycles(g), package_cycles(g)) == ([], [], [])
    assert (upward_arrows(g), torch_in_core(g)) == ([], [])


# ---- the core tests, run without torch --------------------------------------------------------
NO_TORCH = """
import sys

class NoTorch:
    BANNED = {BANNED!r}

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BANNED:
            raise ImportError(f"{{name}} is blocked: tests/core must run without it")
        return None

sys.meta_path.insert(0, NoTorch())
import pytest

code = pytest.main(["tests/core", "-q", "-p", "no:cacheprovider", "-x"])
assert not any(m.split(".")[0] in NoTorch.BANNED for m in sys.modules), "torch was imported"
sys.exit(code)
"""


def test_core_tests_pass_with_torch_unimportable():
    """tests/conftest.py, tests/support and tests/core must not need torch to collect or run."""
    code = NO_TORCH.format(BANNED=sorted(TORCH_LIKE))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
