"""The package layers, checked on the source: lower layers never import upper ones, nothing
below device/ imports torch, nothing below engine/ transformers, and core/ touches no file."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hybridkv"
# Lowest first; a module may import its own layer and the layers below it.
LAYERS = ["core", "ram", "tiers", "config", "cache", "connector", "identity", "device", "engine",
          "integrations", "tools"]
HEAVY = {"torch", "transformers", "vllm"}
LIGHT_LAYERS = {"core", "ram", "tiers", "config", "cache", "connector", "identity"}
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
