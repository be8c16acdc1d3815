"""The large-model machinery: code that exists only to save memory, page faults or time on
models of hundreds of millions of parameters and more, on the CPU. Nothing here changes what
openamct computes (each piece gives the plain path's values, bit for bit or within a few ulps,
as its tests check); a reader of the reference path (mask -> fake-quant -> ``F.linear``,
``load_state_dict``, ``torch.onnx.export``) can skip this package.

Branch points (each names its condition where it is; every one is CPU-only, so a model on CUDA
or meta always runs the plain PyTorch path):

- build, ``pipeline._build``: a model whose tensors are all on the CPU gets a ``LargeRuntime``
  (``runtime.py``), held by its record keeper (``model._openamct.large``) and pointed at by its
  compressed layers and pooled embedding tables (``embedding_grad.py``);
- layer forward, ``CompressedLayer.forward``: ``fused_linear.takes_large_path`` -> the fused
  Linear step / eval (``fused_linear.py``, gradients in ``grad_pool.py``, masks unpacked by
  ``mask_bits.py`` in ``workspace.py`` buffers);
- 2:4 mask recompute, ``nm._keep_of``: 2:4 keep-flags in one workspace per recompute;
- export, ``export.writer.export_pair``: a CPU model is saved streamed (``streamed_save.py``:
  placeholder weights, ``deferred.py``; written one at a time, ``staging.py``; freed heap given
  back between phases, ``memory.py``);
- checkpoint load, ``checkpoint.load_into``: a memory-mapped checkpoint into a CPU model is
  copied a part at a time (``chunked_load.py``);
- record write/read, ``record.file_io``: records of ``LARGE_RECORD_BYTES`` and up are printed
  and parsed by ``text_writer.py`` / ``text_reader.py``; 2:4 masks of large models go to a
  mask file beside the record (``sidecar.py``, chosen by the 2:4 technique's ``to_record``).

No module-level mutable state: buffers belong to a ``LargeRuntime`` (one per compressed model)
or to the call that made them (a recompute's workspace, a save's ``ZeroPages``).
"""
