"""The package's layers import one way (docs/architecture.md).

Every ``import`` in ``flodl_shm`` - module level and inside functions alike - is
resolved and checked against the layer order below. A module may import its
own subpackage and any layer *below* its own; never one above. Two further
never-rules: the numba kernels import no torch, and the checkpoint format
imports no engine, cluster or training code.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "flodl_shm"

#: Lower number = lower layer. Keys are the first component under ``flodl_shm``.
LAYERS = {
    "errors": 0,
    "lifeline": 0,
    "kernels": 1,
    "frame": 2,
    "checkpoint": 3,
    "engine": 4,
    "cluster": 5,
    "wire": 6,         # the public alias of cluster.wire
    "launch": 6,
    "testing": 6,
    "distributed": 6,
    "training": 7,
    "cli": 8,
    "__init__": 9,
    "__main__": 9,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1 and parts[-2] != "flodl_shm":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, mod: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file (``mod``: its module name)."""
    tree = ast.parse(path.read_text(), str(path))
    mod = mod or _module_name(path)
    is_pkg = path.name == "__init__.py"
    package = mod if is_pkg else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # ``from pkg import submodule`` imports the submodule too
            out.extend((node.lineno, f"{target}.{a.name}") for a in node.names
                       if (PKG.parent / f"{target}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                       or (PKG.parent / f"{target}.{a.name}".replace(".", "/") / "__init__.py").exists())
    return out


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _files():
    return sorted(PKG.rglob("*.py"))


def test_every_top_level_name_has_a_layer():
    names = {p.relative_to(PKG).parts[0].removesuffix(".py") for p in _files()}
    assert names <= set(LAYERS), f"give these a layer in LAYERS: {sorted(names - set(LAYERS))}"


def test_imports_run_downwards_only():
    bad = []
    for path in _files():
        mod = _module_name(path)
        own = _layer(mod)
        for line, target in _imports(path):
            if not target.startswith("flodl_shm.") or target == "flodl_shm":
                continue
            other = _layer(target)
            if other == own:
                continue
            if LAYERS[other] >= LAYERS[own]:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} ({own}) imports {target} ({other})")
    assert not bad, "imports that run upwards:\n" + "\n".join(bad)


def test_kernels_import_no_torch():
    bad = [f"{p.relative_to(PKG.parent)}:{line}" for p in (PKG / "kernels").rglob("*.py")
           for line, target in _imports(p) if target == "torch" or target.startswith("torch.")]
    assert not bad, f"the numba kernels must stay torch-free: {bad}"


def test_checkpoint_imports_no_runtime_layer():
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {target}"
           for p in (PKG / "checkpoint").rglob("*.py")
           for line, target in _imports(p)
           if _layer(target) in ("engine", "cluster", "training", "launch", "distributed")
           and target.startswith("flodl_shm.")]
    assert not bad, "the checkpoint format must not depend on the runtime:\n" + "\n".join(bad)


def test_the_checker_sees_function_level_imports(tmp_path):
    """The rule is only as good as its parser: a lazy upward import is caught too."""
    fake = tmp_path / "probe.py"
    fake.write_text("import os\n\ndef f():\n    from ..training import trainer\n")
    found = [t for _, t in _imports(fake, "flodl_shm.engine.probe")]
    assert found == ["os", "flodl_shm.training", "flodl_shm.training.trainer"]
