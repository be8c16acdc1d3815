"""A few optimizer steps on a synthetic loss (mean square of the output): enough to move weights,
2:4 masks and learned clips in lifecycle tests that do not care about accuracy."""

import torch


def sgd_steps(model, inputs, steps=3, lr=0.01, momentum=0.0):
    """``inputs``: a tensor, a tuple/list of positional tensors, a dict of keyword tensors, or a
    callable ``inputs(model)`` that runs the forward and returns the output (a fresh batch each step)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=momentum)
    model.train()
    for _ in range(steps):
        if callable(inputs):
            out = inputs(model)
        elif isinstance(inputs, dict):
            out = model(**inputs)
        else:
            out = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def checkpoint_and_save(model, folder, x, record_file):
    """Eval outputs on ``x``, a checkpoint ``ckpt.pth`` and the two ONNX files ``m_*`` in
    ``folder`` (a pathlib.Path): what restore and export tests compare against."""
    model.eval()
    with torch.no_grad():
        ref = model(x).numpy()
    ckpt = str(folder / "ckpt.pth")
    torch.save({"state_dict": model.state_dict()}, ckpt)
    import openamct as amct

    amct.save_compressed_retrain_model(model, record_file, str(folder / "m"), x, input_names=["x"])
    return ref, ckpt
