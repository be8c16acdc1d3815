"""A few optimizer steps on a synthetic loss (mean square of the output): enough to move weights,
2:4 masks and learned clips in lifecycle tests that do not care about accuracy."""

import torch


def sgd_steps(model, inputs, steps=3, lr=0.01, momentum=0.0):
    """``inputs``: a tensor, a tuple/list of positional tensors, or a dict of keyword tensors."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=momentum)
    model.train()
    for _ in range(steps):
        if isinstance(inputs, dict):
            out = model(**inputs)
        else:
            out = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
