"""How the pipeline wires the large-model machinery into a compressed model: one function per
moment (build, save, restore). Each says its condition; the reference code holds only the
named hooks these fill (listed in ``openamct/large/__init__.py``)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from openamct.large import text_reader, text_writer
from openamct.large.chunked_load import load_in_parts
from openamct.large.mask_bits import keep24_in_workspace
from openamct.large.runtime import attach_runtime, large_path_wanted
from openamct.record.file_io import FastText
from openamct.sparsity.nm import NMSparsifier, apply_bits

__all__ = ["RECORD_TEXT", "at_build", "streamed_save", "part_loader"]

# The record's fast printer and parser (``record.file_io.FastText``) of the large path (they
# give text_format's bytes and messages; every record is printed by the printer, texts of 1 MB
# and up are parsed by the parser).
RECORD_TEXT = FastText(print=text_writer.message_to_text, merge=text_reader.merge_or_decline)


def at_build(model: nn.Module, keeper, layers: dict) -> None:
    """Build, for a model whose tensors are all on the CPU (``pipeline.takes_large_path``
    decided): the keeper prints the record with ``RECORD_TEXT`` and writes large mask sets to a
    mask file; the model gets a ``LargeRuntime``, which its compressed layers' forward
    (``CompressedLayer.large``) and pooled embedding tables use; its n:m sparsifiers multiply by
    their packed masks a slice of rows at a time (``NMSparsifier.apply_packed``) and recompute
    2:4 masks in a workspace (``NMSparsifier.keep24``)."""
    if not large_path_wanted(model):
        raise ValueError("the large-model machinery runs on the CPU only: every parameter and buffer of the "
                         "model must be on the CPU")
    keeper.large_model = True
    keeper.record_text = RECORD_TEXT
    keeper.large = attach_runtime(model, layers)
    for layer in layers.values():
        if isinstance(layer.sparsity, NMSparsifier):
            layer.sparsity.keep24 = keep24_in_workspace
            layer.sparsity.apply_packed = apply_bits


def streamed_save(model: nn.Module) -> Callable | None:
    """Save, on the large path: ``export_pair``'s ``streamed_save`` while the model's parameters
    and buffers are all on the CPU (its writer and zero-page placeholders are CPU-only); None
    otherwise (the model was moved after build)."""
    tensors = [*model.parameters(), *model.buffers()]
    if not all(t.device.type == "cpu" for t in tensors):
        return None
    # Imported here: it loads onnx, which a save needs and an import of openamct does not.
    from openamct.large.streamed_save import export_pair_streamed

    return export_pair_streamed


def part_loader(model: nn.Module) -> Callable | None:
    """Restore, on the large path: ``checkpoint.load_into``'s ``load_parts`` for a CPU model
    (``load_into`` checks again that every tensor of the state dict is on the CPU); None otherwise."""
    return load_in_parts if large_path_wanted(model) else None
