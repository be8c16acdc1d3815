"""House rules of the package layout that a change can silently break (issue 17)."""

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


def test_no_package_file_is_over_450_lines():
    long = []
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py") and not f.endswith("_pb2.py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    n = sum(1 for _ in fh)
                if n > 450:
                    long.append(f"{os.path.relpath(path, PACKAGE)} ({n})")
    assert not long, long


def test_no_module_shadows_the_standard_library():
    names = {os.path.splitext(f)[0] for _, _, files in os.walk(PACKAGE) for f in files if f.endswith(".py")}
    assert not names & set(sys.stdlib_module_names)
