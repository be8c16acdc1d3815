"""The demo config's create -> save and restore -> save write exactly the files they wrote
before the technique-lifecycle redesign: record text and both ONNX files, byte for
byte. The reference files were written once, by the code at e6cf75e, with
``python -m tests.golden.lifecycle tests/fixtures/golden``.

Why bytes can be compared on every machine: tests/golden/lifecycle.py pins every value a
forward computes (clips, output ranges) before anything is saved, so the files depend only on
the seeded weights and on element-wise arithmetic, which the AVX2 and AVX-512 kernels of every
x86-64 CPU this project runs on (AMD EPYC, Intel Xeon) round alike; checked with
ATEN_CPU_CAPABILITY=avx2 and =avx512, with 1 and 2 threads, and two hash seeds.

What later changes add on purpose is taken off before the comparison, and only that: the
record's fingerprint comment lines (``# openamct-...``) and the ONNX files' save id
(one ``metadata_props`` entry). Everything else must be the old bytes.

One change was made on purpose since: a quantized layer's bias is put on the int32 grid the
deploy model adds it on (``CompressedLayer._bias_on_int32_grid``). The two fake-quant
references were rewritten then; they differ from e6cf75e's in four bias initializers only
(layer2-4, fc; by at most 1.5e-5), and the deploy files and records not at all.

And the deploy model's weights are exported as int8 from torch (``WeightDQ``) instead of
quantizing float initializers in the post-pass. The two deploy references were rewritten then:
the same ops, and the same initializer values (compared as a multiset of dtype and bytes); only
initializer order and two kinds of names moved (the weight zero points are now
``<layer>.weight_fn.zeros``, and the exporter's numbering of the float convs' folded weights).
"""

import difflib
import os

import onnx
import pytest

from tests.golden.lifecycle import FILES, write_lifecycle_files

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lifecycle"))
    return dict(zip(FILES, write_lifecycle_files(out)))


def _without_later_additions(name: str, data: bytes) -> bytes:
    if name.endswith(".txt"):
        return b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(b"# openamct-"))
    model = onnx.load_from_string(data)
    added = [p for p in model.metadata_props if p.key.startswith("openamct")]
    assert len(added) <= 1, [p.key for p in added]
    for p in added:
        model.metadata_props.remove(p)
    return model.SerializeToString()


@pytest.mark.parametrize("name", FILES)
def test_file_is_byte_identical_to_the_reference(written, name):
    with open(os.path.join(GOLDEN, name), "rb") as f:
        expected = f.read()
    with open(written[name], "rb") as f:
        got = _without_later_additions(name, f.read())
    if name.endswith(".txt") and got != expected:
        diff = difflib.unified_diff(expected.decode().splitlines(), got.decode().splitlines(),
                                    "reference", "now", lineterm="", n=1)
        pytest.fail(f"{name} differs from the reference:\n" + "\n".join(list(diff)[:40]))
    assert got == expected, f"{name}: {len(got)} bytes now, {len(expected)} in the reference"


def test_restore_writes_what_create_wrote(written):
    for kind in ("record.txt", "fake_quant_model.onnx", "deploy_model.onnx"):
        with open(written[f"create_{kind}"], "rb") as a, open(written[f"restore_{kind}"], "rb") as b:
            assert _without_later_additions(kind, a.read()) == _without_later_additions(kind, b.read()), kind
