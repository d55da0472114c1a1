"""The package layers, checked on the source: lower layers never import upper ones, nothing
below device/ imports torch, nothing below engine/ transformers, core/ touches no file, the
engine-side callers use only the cache's contract, and no module (tests included) reads
another's private names."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hybridkv"
# Lowest first; a module may import its own layer and the layers below it.
LAYERS = ["core", "ram", "tiers", "config", "promotion", "cache", "connector", "identity", "device", "engine",
          "integrations", "tools"]
HEAVY = {"torch", "transformers", "vllm"}
LIGHT_LAYERS = {"core", "ram", "tiers", "config", "promotion", "cache", "connector", "identity"}
FILE_IO = {"os", "pathlib", "tempfile", "shutil", "io", "mmap", "glob"}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "hybridkv" and parts[1] in LAYERS else None


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names if node.module == "hybridkv"]
    return names


MODULES = sorted(p for p in SRC.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_module_respects_layers(path):
    rel = path.relative_to(SRC)
    own = rel.parts[0].removesuffix(".py")
    if own not in LAYERS:
        return                                   # __init__ / __main__ sit above everything
    rank = LAYERS.index(own)
    for name in imports(path):
        target = layer_of(name)
        if target is not None:
            assert LAYERS.index(target) <= rank, f"{rel} ({own}) imports {name} ({target})"
        if own in LIGHT_LAYERS:
            assert name.split(".")[0] not in HEAVY, f"{rel} imports {name} below device/"
        if own == "device":          # runs where only torch is: a GPU check machine
            assert name.split(".")[0] not in {"transformers", "vllm"}, f"{rel} imports {name}"


@pytest.mark.parametrize("path", sorted((SRC / "core").glob("*.py")), ids=lambda p: p.name)
def test_core_is_pure(path):
    """core/ computes (keys, layouts, hit rules, plans): no file, no directory, no process."""
    tree = ast.parse(path.read_text())
    for name in imports(path):
        assert name.split(".")[0] not in FILE_IO, f"core/{path.name} imports {name}"
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert "open" not in calls, f"core/{path.name} opens a file"


def test_every_layer_exists():
    for layer in LAYERS:
        assert (SRC / layer).is_dir() or (SRC / f"{layer}.py").is_file(), layer


# Engine-side callers of the cache: they may use only the ``PageCache`` contract.
CACHE_CALLERS = ["connector.py", "integrations/vllm/scheduler.py", "engine/engine.py", "tools/simulator.py"]


def contract_members() -> set[str]:
    tree = ast.parse((SRC / "cache.py").read_text())
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PageCache")
    names = {n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}
    return names | {n.target.id for n in protocol.body if isinstance(n, ast.AnnAssign)}


def cache_uses(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of every ``cache.x`` and ``<anything>.cache.x`` in a module."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "cache") or \
                    (isinstance(base, ast.Attribute) and base.attr == "cache"):
                uses.append((node.lineno, node.attr))
    return uses


@pytest.mark.parametrize("caller", CACHE_CALLERS)
def test_engine_side_callers_use_only_the_cache_contract(caller):
    allowed = contract_members()
    uses = cache_uses(SRC / caller)
    assert uses, f"{caller} no longer uses the cache: update CACHE_CALLERS"
    outside = [f"{caller}:{line}: cache.{name}" for line, name in uses if name not in allowed]
    assert not outside, "beyond the PageCache contract: " + ", ".join(outside)


STDLIB_PRIVATE = {"_exit", "_replace", "_asdict", "_fields", "_getframe"}
TESTS_DIR = Path(__file__).resolve().parent


@pytest.mark.parametrize("path", MODULES + sorted(TESTS_DIR.rglob("*.py")), ids=str)
def test_no_private_name_is_read_from_another_module(path):
    """``x._name`` only on ``self``/``cls``/``super()`` and ``from m import _name`` never:
    modules meet through public names (tests too: they test behaviour, not internals)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            own = isinstance(base, ast.Name) and base.id in ("self", "cls")
            own |= isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
            if not own and node.attr not in STDLIB_PRIVATE:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridkv"):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")
                      and a.name not in ("_slotpool", "_page_probe")]
    assert not found, f"{path.name} reads private names: " + ", ".join(found)
