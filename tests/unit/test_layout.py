"""House rules of the package layout that a change can silently break."""

import ast
import os
import subprocess
import sys

import openamct

PACKAGE = os.path.dirname(openamct.__file__)


def test_import_openamct_loads_no_demo_plotting_or_transformers():
    code = ("import sys, openamct, openamct.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('matplotlib', 'transformers', 'mlxtend', 'sklearn') or m.startswith('openamct.demo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_package_file_is_over_400_lines():
    long = []
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py") and not f.endswith("_pb2.py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    n = sum(1 for _ in fh)
                if n > 400:
                    long.append(f"{os.path.relpath(path, PACKAGE)} ({n})")
    assert not long, long


def test_no_module_shadows_the_standard_library():
    names = {os.path.splitext(f)[0] for _, _, files in os.walk(PACKAGE) for f in files if f.endswith(".py")}
    assert not names & set(sys.stdlib_module_names)


# The packages of openamct, bottom to top: a module may import from its own package and from
# packages on lower rows only (top-level and function-level imports alike). Top-level modules
# count as packages of their own; ``openamct`` is the package's ``__init__.py``.
LAYERS = [
    ("layer_types", "_atomic", "_checks", "log_summary", "module_tree", "formats", "progress"),
    ("graph",),
    ("config",),
    ("record",),  # file formats only: the record, its attrs and values, the mask file
    ("quant",),
    ("sparsity",),  # filter pruning (channel dependency analysis) and N:M sparsity
    ("compressed",),
    ("techniques",),
    ("training",),  # beside the model while it trains: the record keeper, rollback
    ("export",),
    ("checkpoint", "stats", "output_paths"),
    ("nn",),  # single-op QAT modules and convert_qat_model: over the compressed layer and the export
    ("large",),  # wired in from above (pipeline) through named hooks: never imported below
    ("pipeline",),
    ("tensor_decompose",),  # auto_decomposition / decompose_network: a model transform before create
    ("distill",),  # upstream's distillation family: the group-wise loop over pipeline's create/save
    ("search",),
    ("common",),  # upstream's module paths of the search's base classes (amct_pytorch.common...)
    ("pruning",),  # upstream's one-call amct.prune family: domains over sparsity's graph, search's latency model
    ("api",),
    ("openamct",),
    ("inspection", "record_summary"),
    ("demo", "cli_search"),
    ("cli",),
]
LEVEL = {name: i for i, row in enumerate(LAYERS) for name in row}


def _package_of(path: str) -> str:
    """The layer name of a file of the package: its folder under openamct/, or its module name."""
    rel = os.path.relpath(path, PACKAGE).split(os.sep)
    if len(rel) > 1:
        return rel[0]
    name = os.path.splitext(rel[0])[0]
    return "openamct" if name == "__init__" else name


def _imported_packages(node: ast.AST) -> list[str]:
    """The openamct packages an import statement reads (``from openamct import x``: package x)."""
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        parts = node.module.split(".")
        if parts[0] != "openamct":
            return []
        return [a.name for a in node.names] if len(parts) == 1 else [parts[1]]
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1] if "." in a.name else "openamct" for a in node.names
                if a.name.split(".")[0] == "openamct"]
    return []


def _package_files():
    for folder, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(folder, f)


def test_every_package_has_a_layer():
    found = {_package_of(path) for path in _package_files()}
    assert not found - set(LEVEL), f"add these to LAYERS in {__file__}: {sorted(found - set(LEVEL))}"


def test_imports_point_one_way():
    wrong = []
    for path in _package_files():
        src = _package_of(path)
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                wrong.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}: a relative import (write openamct.…)")
            for dst in _imported_packages(node):
                if dst != src and LEVEL.get(dst, len(LAYERS)) >= LEVEL.get(src, -1):
                    wrong.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}: {src} imports {dst}, "
                                 "which is not below it")
    assert not wrong, "\n".join(wrong)


def test_the_package_speaks_to_its_users():
    """Comments and docstrings say what the code does and why; the project's history (issue
    numbers, notes about one machine, references to files outside the repository) is in git."""
    import re

    history = re.compile(r"\b[Ii]ssues?\s*#?\s*\d+|\bthese\s+VMs\b|\bthis\s+VM\b|SPEC\s*§|PLATFORM-NOTES")
    root = os.path.dirname(PACKAGE)
    found = []
    for path in [*_package_files(), os.path.join(root, "README.md"),
                 *(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "docs")) for f in fs)]:
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        found += [f"{os.path.relpath(path, root)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
                  for m in history.finditer(text)]
    assert not found, "\n".join(found)
