"""Where the fake-quant ONNX file and the PyTorch model it was saved from part: every
activation quantizer's output compared element by element, torch (a forward hook on the
layer's ``act_quant``) against ONNX Runtime (the fake-quant file with each quantizer's
``Round`` input and dequantized output added as graph outputs), on the zoo lifecycle's five
batches after the same INT8 create and two training steps (tests/zoo/lifecycle.py).

For each batch: the output cosine, how many quantizers have an element a whole step apart,
and for the first ones, how far the element's pre-rounding value sat from a rounding midpoint
(in steps). A first difference of one element, one step, a few 1e-6 from a midpoint is float
accumulation order (another runtime's ulp), not a rounding rule one side applies; a rounding
rule would move many elements of the first quantizer where it applies, on every batch. Next to
it, lifecycle.self_vs_noise: the model against itself under 1e-6 noise at every layer's input
(< 0.999: chaotic, such flips are expected to grow to the output). About a minute a net.

    python -m benchmarks.quant_flips torchvision MobileNetV2
    python -m benchmarks.quant_flips timm ReXNet
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

import openamct as amct
from tests.zoo.lifecycle import CONFIGS, _batches, _train, cosine, first_tensor, self_vs_noise


def _layer(node_name: str) -> str:
    """Module path of the layer whose input quantizer a ``/a/a.0/b/pre/Round`` node belongs to
    (the exporter writes a Sequential child's scope as its dotted name: ``a.0``)."""
    path: list[str] = []
    for seg in node_name.strip("/").rsplit("/pre/", 1)[0].split("/"):
        if path and seg.startswith(path[-1] + "."):
            path[-1] = seg
        else:
            path.append(seg)
    return ".".join(path)


def _probes(path: str, out: str) -> list[tuple[str, str, str, float]]:
    """(layer, Round input, dequantized output, scale) of every per-tensor input quantizer
    (Round -> Add -> Clip -> Sub -> Mul); writes the file with them as outputs to ``out``."""
    model = onnx.load(path)
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].HasField("t")}
    consts.update({i.name: numpy_helper.to_array(i) for i in model.graph.initializer})
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    probes = []
    for r in (n for n in model.graph.node if n.op_type == "Round" and "/pre/" in n.name):
        mul = r
        for _ in range(4):
            mul = readers[mul.output[0]][0]
        scale = next((consts[i] for i in mul.input if i in consts), None)
        if mul.op_type == "Mul" and scale is not None and scale.size == 1:
            probes.append((_layer(r.name), r.input[0], mul.output[0], float(scale.ravel()[0])))
    have = {o.name for o in model.graph.output}
    for _, pre, deq, _ in probes:
        for name in (pre, deq):
            if name not in have:
                model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
                have.add(name)
    onnx.save(model, out)
    return probes


def main(zoo: str, family: str) -> None:
    if zoo == "timm":
        from tests.zoo.timm_families import build
    else:
        from tests.zoo.torchvision_families import build
    torch.set_num_threads(1)
    model, inputs = build(family)
    with tempfile.TemporaryDirectory() as folder:
        cfg, rec = os.path.join(folder, "retrain.cfg"), os.path.join(folder, "record.txt")
        with open(cfg, "w") as f:
            f.write(CONFIGS["int8"])
        with torch.no_grad():
            target = first_tensor(model(**inputs)).float()
        c = amct.create_compressed_retrain_model(model, inputs, cfg, rec)
        _train(c, inputs, target)
        c.eval()
        amct.save_compressed_retrain_model(c, rec, os.path.join(folder, "m"), inputs)
        probe = os.path.join(folder, "probe.onnx")
        probes = _probes(os.path.join(folder, "m_fake_quant_model.onnx"), probe)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        sess = ort.InferenceSession(probe, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    modules = dict(c.named_modules())
    probes = [p for p in probes if getattr(modules.get(p[0]), "act_quant", None) is not None]
    caught: dict[str, np.ndarray] = {}
    for layer, *_ in probes:
        modules[layer].act_quant.register_forward_hook(
            lambda m, a, o, k=layer: caught.__setitem__(k, o.detach().numpy()))
    batches = _batches(inputs)
    noise, noise_min = self_vs_noise(c, batches)
    print(f"{zoo} {family}: {len(probes)} input quantizers compared; self_vs_noise {noise:.5f} "
          f"(worst batch {noise_min:.5f})")
    for i, b in enumerate(batches):
        caught.clear()
        with torch.no_grad():
            ref = first_tensor(c(**b)).numpy()
        outs = dict(zip(names, sess.run(None, {x.name: b[x.name].numpy() for x in sess.get_inputs()}), strict=True))
        apart = []
        for k, (layer, pre, deq, scale) in enumerate(probes):
            steps = np.abs(caught[layer] - outs[deq]) / scale
            if (steps > 0.5).any():
                at = tuple(np.argwhere(steps > 0.5)[0])
                mid = abs(float(outs[pre][at]) % 1.0 - 0.5)
                apart.append(f"#{k} {layer}: {int((steps > 0.5).sum())} of {steps.size} elements, max "
                             f"{steps.max():.0f} steps, first {mid:.1e} from a midpoint")
        print(f"  batch {i}: cosine ORT vs torch {cosine(outs[names[0]], ref):.5f}; "
              f"{len(apart)} quantizers apart" + ("; first: " + " | ".join(apart[:2]) if apart else ""))


if __name__ == "__main__":
    main(*sys.argv[1:3])
