"""``mhc_megatron/kernels/`` is a leaf package: its modules import torch, triton, the standard
library and each other, nothing else of mhc_megatron (the recompute registers the kernels'
replay fusion itself, the rest of the package imports the kernels, never the other way), and
no module imports a private name of another only to hand it on."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "mhc_megatron" / "kernels"
PACKAGE = "mhc_megatron.kernels"
ALLOWED_TOP = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names)
ENTRY_POINTS = ("__init__.py", "triton_mhc.py")  # what other packages and tests import


def _modules():
    paths = sorted(KERNELS.rglob("*.py"))
    assert paths, f"no modules under {KERNELS}"
    return [(p, ast.parse(p.read_text(), filename=str(p))) for p in paths]


def _dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, tree: ast.Module):
    """``(line, module, names)`` for every import in ``tree``, at any depth (inside functions
    too), relative ones resolved; ``importlib.import_module`` / ``__import__`` of a constant
    name included."""
    package = _dotted(path) if path.name == "__init__.py" else _dotted(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            yield node.lineno, module, tuple(alias.name for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            yield node.lineno, node.args[0].value, ()


def _allowed(module: str, names: tuple) -> bool:
    if module == PACKAGE or module.startswith(PACKAGE + "."):
        return True
    if module == "mhc_megatron":  # ``from mhc_megatron import kernels``
        return bool(names) and all(name == "kernels" for name in names)
    return module.split(".")[0] in ALLOWED_TOP


def test_kernels_import_only_torch_triton_stdlib_and_themselves():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 + (f" ({', '.join(names)})" if names else "")
                 for path, tree in _modules() for line, module, names in _imports(path, tree)
                 if not _allowed(module, names)]
    assert not offenders, ("mhc_megatron/kernels/ imports outside torch, triton, the standard "
                           "library and itself:\n  " + "\n  ".join(offenders))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dunder_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
            return [elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)]
    return []


def test_no_private_names_are_reexported():
    """A private name imported from another module of the package must be used where it is
    imported (not imported only to be handed on), no ``__all__`` lists a private name, and the
    entry points import no private names at all: callers (tests, benchmarks) import them from
    the module that defines them."""
    offenders = []
    for path, tree in _modules():
        where = path.relative_to(ROOT)
        used = {node.id for node in ast.walk(tree)
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias in node.names:
                if not _private(alias.name):
                    continue
                if path.name in ENTRY_POINTS:
                    offenders.append(f"{where}:{node.lineno}: the entry point imports "
                                     f"{alias.name}")
                elif (alias.asname or alias.name) not in used:
                    offenders.append(f"{where}:{node.lineno}: {alias.name} imported, never used")
        offenders += [f"{where}: __all__ lists {name}" for name in _dunder_all(tree)
                      if _private(name)]
    assert not offenders, "private names re-exported:\n  " + "\n  ".join(offenders)


def test_loading_the_kernels_loads_nothing_else_of_the_package():
    """At run time too: importing the kernels and loading the Triton ops (interpreter) pulls in
    no other module of mhc_megatron than the package's own ``__init__`` and its logging
    set-up, and no Megatron."""
    code = ("import sys\n"
            "from mhc_megatron.kernels import dispatch\n"
            "dispatch._load_triton_ops()\n"
            "print('\\n'.join(sorted(sys.modules)))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = proc.stdout.split()
    assert "mhc_megatron.kernels.triton_mhc" in loaded
    allowed = ("mhc_megatron", "mhc_megatron._logging")
    others = [m for m in loaded if m.split(".")[0] == "megatron"
              or (m.startswith("mhc_megatron") and m not in allowed and not m.startswith(PACKAGE))]
    assert not others, others
