"""The demo config's create -> save and restore -> save write exactly the files they wrote
before the technique-lifecycle redesign (issue 17): record text and both ONNX files, byte for
byte. The reference files were written once, by the code at e6cf75e (regenerated on purpose for
issue 16: the ONNX files gained one metadata_props entry, the save id, and the records the
fingerprint comment lines at their top; nothing else moved), with
``python -m tests.golden.lifecycle tests/fixtures/golden``.

Why bytes can be compared on every machine: tests/golden/lifecycle.py pins every value a
forward computes (clips, output ranges) before anything is saved, so the files depend only on
the seeded weights and on element-wise arithmetic, which the AVX2 and AVX-512 kernels of every
x86-64 CPU this project runs on (AMD EPYC, Intel Xeon) round alike; checked with
ATEN_CPU_CAPABILITY=avx2 and =avx512, with 1 and 2 threads, and two hash seeds.
"""

import difflib
import os

import pytest

from tests.golden.lifecycle import FILES, write_lifecycle_files

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lifecycle"))
    return dict(zip(FILES, write_lifecycle_files(out)))


@pytest.mark.parametrize("name", FILES)
def test_file_is_byte_identical_to_the_reference(written, name):
    with open(os.path.join(GOLDEN, name), "rb") as f:
        expected = f.read()
    with open(written[name], "rb") as f:
        got = f.read()
    if name.endswith(".txt") and got != expected:
        diff = difflib.unified_diff(expected.decode().splitlines(), got.decode().splitlines(),
                                    "reference", "now", lineterm="", n=1)
        pytest.fail(f"{name} differs from the reference:\n" + "\n".join(list(diff)[:40]))
    assert got == expected, f"{name}: {len(got)} bytes now, {len(expected)} in the reference"


def test_restore_writes_what_create_wrote(written):
    for kind in ("record.txt", "fake_quant_model.onnx", "deploy_model.onnx"):
        with open(written[f"create_{kind}"], "rb") as a, open(written[f"restore_{kind}"], "rb") as b:
            assert a.read() == b.read(), kind
