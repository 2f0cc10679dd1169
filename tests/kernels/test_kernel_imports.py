"""Imports run one way: titan_mok -> titan_mok.kernels, never back. Every module under kernels/ (installed as
titan_mok.kernels) is parsed, function-local imports included, and may import from titan_mok only titan_mok.kernels."""

import ast
import pathlib

import pytest

from tests.torchrun import REPO

KERNEL_MODULES = sorted((REPO / "kernels").rglob("*.py"))


def imports_outside_kernels(source: str) -> list[str]:
    """The titan_mok modules (or names from titan_mok) that source imports, other than titan_mok.kernels and below."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _outside(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "titan_mok":  # from titan_mok import X: X must be kernels
                found += [f"titan_mok.{alias.name}" for alias in node.names if alias.name != "kernels"]
            elif _outside(node.module):
                found.append(node.module)
    return found


def _outside(module: str) -> bool:
    inside = module == "titan_mok.kernels" or module.startswith("titan_mok.kernels.")
    return (module == "titan_mok" or module.startswith("titan_mok.")) and not inside


def test_the_check_sees_every_form_of_import():
    source = """
import titan_mok.moe.dispatch
from titan_mok.rl import generate
from titan_mok import moe, kernels
import titan_mok
from titan_mok.kernels import grouped_gemm
from titan_mok.kernels.mxfp8 import MXTensor
import torch

def f():
    from titan_mok.moe.tiles import map_row_tiles
"""
    assert imports_outside_kernels(source) == ["titan_mok.moe.dispatch", "titan_mok.rl", "titan_mok.moe", "titan_mok",
                                               "titan_mok.moe.tiles"]


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=[str(p.relative_to(REPO)) for p in KERNEL_MODULES])
def test_kernels_import_only_kernels_from_titan_mok(path: pathlib.Path):
    assert imports_outside_kernels(path.read_text()) == [], f"{path.relative_to(REPO)} imports titan_mok outside kernels"


def test_every_kernel_module_is_checked():
    assert {p.name for p in KERNEL_MODULES} >= {"grouped_ffn.py", "grouped_gemm.py", "mok_combine.py", "mxfp8.py"}
