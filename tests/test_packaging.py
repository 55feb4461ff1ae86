"""What the installed package holds: ``mhc_megatron`` and its subpackages only. The CPU shims
and test stand-ins (``mhc_testing/``) stay in the repository, and no product module imports
them."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_packages_are_mhc_megatron_only():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    packages = setuptools.find_packages(str(ROOT), include=find["include"],
                                        exclude=find.get("exclude", ()))
    assert "mhc_megatron" in packages and "mhc_megatron.kernels" in packages, packages
    assert all(p == "mhc_megatron" or p.startswith("mhc_megatron.") for p in packages), packages
    assert not any("testing" in p for p in packages), packages


def test_product_code_never_imports_the_test_support():
    offenders = []
    for path in sorted((ROOT / "mhc_megatron").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] == "mhc_testing" or ".testing" in n]
    assert not offenders, offenders
