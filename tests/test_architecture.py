"""The layers of hf_dsinfer, lowest first, and the rule that imports run one way: a module may
import its own layer or a lower one, never a higher one, and no modules import each other in a
cycle (function-level imports count too; imports under `if TYPE_CHECKING:`, which only name
types for annotations and never run, do not). docs/architecture.md explains each layer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hf_dsinfer

ROOT = Path(hf_dsinfer.__file__).parent

# Layer of each module, by the longest matching prefix. Lowest first.
LAYERS = [
    ("base", ["errors", "settings", "state", "hardware"]),  # no hf_dsinfer imports but errors
    ("kernels", ["kernels"]),  # tensors in, tensors out; the native library
    ("config", ["config", "offload.__init__", "offload.policy"]),  # frozen, validated settings
    ("hf", ["hf"]),  # the adapter of transformers' internals
    ("injection", ["injection"]),  # fused blocks, policies, the injection layer's phases
    ("parallel/offload", ["parallel", "offload"]),  # TP / EP, FlexGen offload
    ("phases", ["phases"]),  # the pipeline that runs every phase in order
    ("api", ["api", "default_model", "offload.search", "evaluate"]),  # entry points and tools
    ("integration", ["integration", "benchmark"]),  # plugged into transformers' entry points
    ("serve", ["serve"]),  # hf-dsinfer serve: the HTTP server over continuous batching
    ("cli", ["cli", "__init__"]),
]
RANK = {prefix: rank for rank, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts
    return ".".join(parts)  # "offload.__init__", "kernels.quant", "__init__"


def _layer(module: str) -> int:
    best = None
    for prefix, rank in RANK.items():
        matches = module == prefix or module.startswith(prefix + ".")
        if matches and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return (node.module or "").removeprefix("hf_dsinfer").lstrip(".") or "__init__"
    package = module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else [])) or "__init__"


def _imports(runtime_only: bool = False) -> dict[str, set[tuple[str, int]]]:
    """module -> {(imported hf_dsinfer module, line)} over every import statement in it
    (`runtime_only`: leaving out those under `if TYPE_CHECKING:`, which never run)."""
    modules = {_module_name(p) for p in ROOT.rglob("*.py")}
    found: dict[str, set[tuple[str, int]]] = {}
    for path in ROOT.rglob("*.py"):
        module = _module_name(path)
        edges = found.setdefault(module, set())
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for guard in ast.walk(tree) if isinstance(guard, ast.If)
                       and getattr(guard.test, "id", None) == "TYPE_CHECKING"
                       for n in ast.walk(guard)}
        for node in ast.walk(tree):
            if runtime_only and id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level == 0 and not (node.module or "").startswith("hf_dsinfer"):
                    continue
                base = _resolve(module, node)
                # `from pkg import mod` imports pkg.mod when it is a module
                pkg = "" if base == "__init__" else f"{base}."
                targets = [f"{pkg}{a.name}" if f"{pkg}{a.name}" in modules
                           or f"{pkg}{a.name}.__init__" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.removeprefix("hf_dsinfer").lstrip(".") or "__init__"
                           for a in node.names if a.name.split(".")[0] == "hf_dsinfer"]
            for target in targets:
                target = target if target in modules else f"{target}.__init__"
                if target in modules and target != module:
                    edges.add((target, node.lineno))
    return found


def test_every_module_has_a_layer():
    for path in ROOT.rglob("*.py"):
        _layer(_module_name(path))


def test_imports_only_go_down():
    upward = [f"{m}:{line} imports {t} ({LAYERS[_layer(t)][0]} is above {LAYERS[_layer(m)][0]})"
              for m, edges in sorted(_imports(runtime_only=True).items())
              for t, line in sorted(edges)
              if _layer(t) > _layer(m)]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = {m: {t for t, _ in edges} for m, edges in _imports(runtime_only=True).items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]))
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_kernels_read_no_modules_or_configs():
    """kernels/ works on tensors: no nn.Module classes of ours, no config objects."""
    for path in (ROOT / "kernels").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"from hf_dsinfer\.(config|injection|parallel|offload)", text), path
        assert "isinstance(module" not in text, path


def test_error_classes_live_in_errors():
    for path in ROOT.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                assert not bases & {"Exception", "DSInferError", "ValueError", "RuntimeError"}, (
                    f"{path.relative_to(ROOT)}: {node.name} is an error class; define it in "
                    "hf_dsinfer/errors.py")


def test_one_owner_of_model_generate():
    """Only hf_dsinfer.phases sets `<model>.generate`; the phases that change what generate
    does (offload, pipeline, TP, EP) give it a wrapper to install."""
    setters = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if (isinstance(target, ast.Attribute) and target.attr == "generate"
                        and getattr(target.value, "id", None) != "self"):
                    setters.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert [where.split(":")[0] for where in setters] == ["phases.py"], setters
