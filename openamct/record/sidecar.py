"""Large 2:4 masks kept beside the record, in one binary file the record names.

Inline, a mask costs ~20 bytes of text per 64 weights: 116 MB for a 246M-parameter model,
rewritten every time a scale changes. Above ``SIDECAR_MIN_WEIGHTS`` masked weights in total the
record keeps each mask's ``mask_shape`` and, instead of ``selective_mask``, where its words lie:

    attr { name: "mask_file"        type: STRING s: "record.txt.masks-<sha256[:16]>.bin" }
    attr { name: "mask_file_bytes"  type: INT    i: <size of that file> }
    attr { name: "mask_file_sha256" type: STRING s: "<sha256 of that file, hex>" }
    attr { name: "mask_offset"      type: INT    i: <byte offset of this mask's words> }

The file holds the masks' int64 words (mask_codec's layout, little-endian) back to back. Its name
carries its hash, so it is written once per set of masks and never rewritten in place: a write
that only changes scales touches the text record alone. Order of a write: the new mask file
(atomic), then the record (atomic), then the mask files of this record that it no longer names.
A crash at any point leaves a record whose mask file exists. Restore checks the file's size and
SHA-256 before reading a mask and refuses a mismatch naming the file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re

import numpy as np
from torch import Tensor

from openamct._atomic import atomic_write_bytes
from openamct.record import attrs
from openamct.record.mask_codec import words_of_bits
from openamct.record.scale_offset_record_pb2 import PruneNode, ScaleOffsetRecord

logger = logging.getLogger(__name__)

# Below this, masks stay inline (upstream's form; the demo's record keeps its bytes): ~1.3 MB
# of record text.
SIDECAR_MIN_WEIGHTS = 1 << 22

FILE, FILE_BYTES, FILE_SHA, OFFSET = "mask_file", "mask_file_bytes", "mask_file_sha256", "mask_offset"


def sidecar_name(record_base: str, sha: str) -> str:
    return f"{record_base}.masks-{sha[:16]}.bin"


def _pattern(record_base: str) -> re.Pattern:
    return re.compile(re.escape(record_base) + r"\.masks-[0-9a-f]{16}\.bin")


class MaskBlob:
    """The packed words of a set of masks, back to back, with each mask's offset: the masks'
    own bits, read where they lie (``mask_codec.words_of_bits``), not a copy. A copy cost the
    first training step 1/32 of the weights' bytes in new pages (130 MB at 1.1B parameters,
    0.9 s on a 2-core EPYC). So the masks must not change while a write reads them: the record
    keeper joins its write before a forward that computes a mask, before a failed forward's
    masks are put back and before ``load_state_dict`` (training/keeper.py). Changed masks get a new
    blob (the owner keys it by the masks' versions). The SHA-256 is computed on first use,
    which ``SidecarOut.finish`` leaves to the thread that writes the record: at 250M parameters
    it was 13-80 ms of the training step (SHA-NI or not), at 1.1B up to 0.5 s."""

    def __init__(self, parts: list[tuple[str, Tensor]]) -> None:
        self.offsets: dict[str, int] = {}
        self._bits = [bits for _, bits in parts]  # tensors: a deep copy of the model maps them to its own
        pos = 0
        for name, bits in parts:
            self.offsets[name] = pos
            pos += -(-bits.numel() // 8) * 8  # whole int64 words
        self.nbytes = pos
        # No lock: one thread at a time uses a blob (the keeper joins a write's thread before it
        # builds the next record), and a lock would make the model impossible to deep-copy.
        self._sha256: str | None = None

    def chunks(self) -> list:
        """The file's content, one bytes-like piece per mask."""
        return [words_of_bits(bits) for bits in self._bits]

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            h = hashlib.sha256()
            for chunk in self.chunks():
                h.update(chunk)
            self._sha256 = h.hexdigest()
        return self._sha256


class SidecarOut:
    """What one record write puts beside the record: the blobs its entries name. ``describe``
    leaves each entry's file name and hash empty; ``finish`` fills them in before the record
    is compared or written."""

    def __init__(self, record_path: str) -> None:
        self.record_base = os.path.basename(os.path.abspath(record_path))
        self.blobs: list[MaskBlob] = []
        self._pending: list[tuple[PruneNode, MaskBlob]] = []

    def add(self, blob: MaskBlob) -> None:
        self.blobs.append(blob)

    def describe(self, node: PruneNode, name: str, blob: MaskBlob) -> None:
        """Attrs saying where mask ``name``'s words lie in ``blob``'s file (named by ``finish``)."""
        attrs.add_str(node, FILE, "")
        attrs.add_int(node, FILE_BYTES, blob.nbytes)
        attrs.add_str(node, FILE_SHA, "")
        attrs.add_int(node, OFFSET, blob.offsets[name])
        self._pending.append((node, blob))

    def finish(self) -> None:
        """Hash each blob (once) and write its file name and hash into the entries naming it."""
        for node, blob in self._pending:
            attrs.find(node, FILE).s = sidecar_name(self.record_base, blob.sha256).encode("utf-8")
            attrs.find(node, FILE_SHA).s = blob.sha256.encode("utf-8")
        self._pending.clear()


def write_sidecars(record_path: str, blobs: list[MaskBlob]) -> None:
    """Write the mask files a record about to be written names (those not already there)."""
    folder, base = os.path.split(os.path.abspath(record_path))
    for blob in blobs:
        path = os.path.join(folder, sidecar_name(base, blob.sha256))
        # Content-addressed: a file of that name and size is this blob (restore checks the hash).
        if os.path.isfile(path) and os.path.getsize(path) == blob.nbytes:
            continue
        atomic_write_bytes(path, blob.chunks())
        logger.debug("mask file written: %s (%d bytes)", path, blob.nbytes)


def remove_unnamed_sidecars(record_path: str, record: ScaleOffsetRecord) -> None:
    """After the record is in place: drop this record's older mask files it no longer names."""
    folder, base = os.path.split(os.path.abspath(record_path))
    named = {attrs.get_str(pr.selective_prune, FILE) for pr in record.prune_record if pr.HasField("selective_prune")}
    pattern = _pattern(base)
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        if pattern.fullmatch(entry) and entry not in named:
            try:
                os.remove(os.path.join(folder, entry))
            except OSError as exc:
                logger.debug("old mask file %s not removed: %s", entry, exc)


class SidecarReader:
    """Verified access to the mask files one record names (each file read and checked once)."""

    def __init__(self, record_path: str | None) -> None:
        self.folder = os.path.dirname(os.path.abspath(record_path)) if record_path else None
        self._files: dict[str, tuple[bytes, str]] = {}  # path -> (content, its sha256)

    def words(self, node: PruneNode, count: int) -> np.ndarray:
        name = attrs.get_str(node, FILE)
        if self.folder is None:
            raise ValueError(f"record_file: selective_prune {node.name!r} keeps its mask in {name!r}, which can "
                             "only be read together with the record file's path")
        if os.path.basename(name) != name or not name:
            raise ValueError(f"record_file: selective_prune {node.name!r}: mask_file {name!r} must be a file name "
                             "in the record's folder, not a path")
        data = self._load(node, os.path.join(self.folder, name))
        offset = attrs.get_int(node, OFFSET)
        if offset is None or offset < 0 or offset % 8 or offset + 8 * count > len(data):
            raise ValueError(f"record_file: selective_prune {node.name!r}: mask_offset {offset} with {count} words "
                             f"lies outside mask file {os.path.join(self.folder, name)!r} ({len(data)} bytes)")
        return np.frombuffer(data, dtype="<i8", count=count, offset=offset)

    def _load(self, node: PruneNode, path: str) -> bytes:
        size, sha = attrs.get_int(node, FILE_BYTES), attrs.get_str(node, FILE_SHA)
        if path not in self._files:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as exc:
                raise ValueError(f"record_file: mask file {path!r} (named by selective_prune {node.name!r}) cannot "
                                 f"be read: {exc}") from None
            if size != len(data):
                raise ValueError(f"record_file: mask file {path!r} has {len(data)} bytes but the record says {size}: "
                                 "it was changed or cut short after the record was written")
            digest = hashlib.sha256(data).hexdigest()
            if digest != sha:
                raise ValueError(f"record_file: mask file {path!r} does not match the record (sha256 {digest[:16]}... "
                                 f"but the record says {str(sha)[:16]}...): it was changed after the record was written")
            self._files[path] = (data, digest)
        data, digest = self._files[path]
        if (size, sha) != (len(data), digest):
            raise ValueError(f"record_file: selective_prune {node.name!r} gives mask file {path!r} another size or "
                             "sha256 than the record's other masks")
        return data
