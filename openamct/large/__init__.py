"""The large-model machinery: code that exists only to save memory, page faults or time on
models of hundreds of millions of parameters and more, on the CPU. Nothing here changes what
openamct computes (each piece gives the plain path's values, bit for bit or within a few ulps,
as its tests check); a reader of the reference path (mask -> fake-quant -> ``F.linear``,
``load_state_dict``, ``torch.onnx.export``) can skip this package.

Nothing below ``pipeline`` imports this package: the reference code exposes one named hook
per branch point, states its condition there, and ``attach.py`` fills the hooks, called by the
pipeline at build, save and restore. Every CPU-only hook is filled only for a model whose
tensors are all on the CPU, so a model on CUDA or meta always runs the plain PyTorch path.

- build, ``attach.at_build``: a CPU model gets a ``LargeRuntime`` (``runtime.py``), held by its
  record keeper (``model._openamct.large``) and used by its pooled embedding tables
  (``embedding_grad.py``);
- layer forward, ``CompressedLayer.large`` (the runtime; ``takes``/``forward``): a CPU Linear
  whose weight path is only a 2:4 mask and/or ARQ runs the fused Linear (``fused_linear.py``,
  gradients in ``grad_pool.py``, masks unpacked by ``mask_bits.py`` in ``workspace.py`` buffers);
- 2:4 mask recompute, ``NMSparsifier.keep24`` (``prune.nm._keep_of``): on a CPU weight with no
  2:4 group padded or cut, keep-flags in one workspace per recompute (``mask_bits.py``);
- export, ``export.writer.export_pair(streamed_save=)`` (``attach.streamed_save``): a CPU model
  is saved streamed (``streamed_save.py``: weights deferred through
  ``export.export_layer.fold_layers(defer=)``, ``deferred.py``; written one at a time,
  ``staging.py``; freed heap given back between phases, ``memory.py``);
- checkpoint load, ``checkpoint.load_into(load_parts=)`` (``attach.part_loader``): a
  memory-mapped checkpoint into a CPU model is copied a part at a time (``chunked_load.py``);
- record write/read, ``record.file_io``'s ``fast`` (a ``FastText``; ``attach.RECORD_TEXT``, for
  any device: the same bytes, only faster): records are printed by ``text_writer.py``, and
  texts of ``LARGE_RECORD_BYTES`` and up parsed by ``text_reader.py``.

No module-level mutable state: buffers belong to a ``LargeRuntime`` (one per compressed model)
or to the call that made them (a recompute's workspace, a save's ``ZeroPages``).
"""
