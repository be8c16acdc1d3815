"""A restore copies a memory-mapped checkpoint into the model a part at a time and gives each
part's file pages back once copied: the same model as one load, less memory."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import openamct as amct
from openamct.large import chunked_load as checkpoint
from openamct.large.memory import drop_file_pages

CFG = ("retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"
       "prune_config { n_out_of_m_pruner { l1_selective_prune { } } }\n")


class Tied(nn.Module):
    """An embedding and a head sharing one weight, as language models do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 32)
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(self.emb(ids))))))


IDS = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parts")
    cfg, rec, pth = (str(folder / n) for n in ("c.cfg", "r.txt", "ckpt.pth"))
    with open(cfg, "w") as f:
        f.write(CFG)
    work = amct.create_compressed_retrain_model(Tied(), IDS, cfg, rec, large_model=True)
    opt = torch.optim.SGD([p for p in work.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        work(IDS).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    torch.save({"state_dict": work.state_dict()}, pth)
    return work, cfg, rec, pth


@pytest.mark.parametrize("part_bytes,at_least", [(1, 1), (3000, 1), (1 << 40, 16), (1 << 40, 1)])
def test_a_restore_in_parts_is_the_restore_in_one(trained, part_bytes, at_least, monkeypatch):
    work, cfg, rec, pth = trained
    dropped = []

    def spy(tensors):
        tensors = list(tensors)
        dropped.append(len(tensors))
        drop_file_pages(tensors)

    monkeypatch.setattr(checkpoint, "LOAD_PART_BYTES", part_bytes)
    monkeypatch.setattr(checkpoint, "LOAD_PARTS", at_least)
    monkeypatch.setattr(checkpoint, "drop_file_pages", spy)
    back = amct.restore_compressed_retrain_model(Tied(), IDS, cfg, rec, pth, "state_dict", large_model=True)
    want, got = work.state_dict(), back.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert back.emb.weight is back.head.weight  # still one weight
    work.eval(), back.eval()
    with torch.no_grad():
        assert torch.equal(back(IDS), work(IDS))
    work.train()
    assert sum(dropped) == len(want)  # every tensor came from the mapped file and was dropped
    if part_bytes == 1:
        assert len(dropped) == len(want)  # a key per part
    elif at_least == 1 and part_bytes > 1 << 30:
        assert len(dropped) == 1  # all at once, as one load_state_dict
    else:
        assert 2 < len(dropped) < len(want)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_dropped_file_pages_leave_memory_and_read_back_from_the_file(tmp_path):
    path = str(tmp_path / "big.pth")
    torch.save({"w": torch.arange(16 << 20, dtype=torch.float32)}, path)  # 64 MB
    t = torch.load(path, mmap=True, weights_only=True)["w"]
    total = float(t.sum())  # every page read
    before = _rss()
    drop_file_pages([t])
    after = _rss()
    assert before - after > 48 << 20, (before, after)
    assert float(t.sum()) == total and float(t[-1]) == (16 << 20) - 1  # back from the file


class BigTable(nn.Module):
    """An embedding table of 64 MB beside small layers: one tensor many load parts long, as a
    language model's vocabulary table is at 60M parameters (a quarter of the weights)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(65536, 256)
        self.fc = nn.Linear(256, 64)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def _mapped_rss(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) > 1 and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
                ours = line.rstrip().endswith(path)
            elif ours and head[0] == "Rss:":
                total += int(head[1]) << 10
    return total


def _big_table_checkpoint(folder, poison: bool = False):
    cfg, rec, pth = (str(folder / n) for n in ("c.cfg", "r.txt", "ckpt.pth"))
    with open(cfg, "w") as f:
        f.write(CFG)
    ids = torch.randint(0, 65536, (2, 8), generator=torch.Generator().manual_seed(1))
    work = amct.create_compressed_retrain_model(BigTable(), ids, cfg, rec, large_model=True)
    work(ids).sum().backward()
    with torch.no_grad():
        work.emb.weight.add_(1.0)  # not the caller's values: the restore must copy them in
        if poison:
            work.emb.weight[-1, -1] = float("nan")  # in the last slice
    torch.save({"state_dict": work.state_dict()}, pth)
    return work, ids, cfg, rec, pth


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_tensor_larger_than_a_part_is_copied_a_slice_at_a_time(tmp_path, monkeypatch):
    work, ids, cfg, rec, pth = _big_table_checkpoint(tmp_path)
    table = work.emb.weight.nbytes
    seen = []  # the file's resident mapped bytes just before each drop of its pages

    def spy(real):
        def dropping(arg):
            arg = list(arg) if not isinstance(arg, torch.Tensor) else arg
            seen.append(_mapped_rss(os.path.realpath(pth)))
            real(arg)
        return dropping

    monkeypatch.setattr(checkpoint, "drop_file_pages", spy(checkpoint.drop_file_pages))
    monkeypatch.setattr(checkpoint, "drop_file_range", spy(checkpoint.drop_file_range))
    back = amct.restore_compressed_retrain_model(BigTable(), ids, cfg, rec, pth, "state_dict", large_model=True)
    assert torch.equal(back.emb.weight, work.emb.weight) and torch.equal(back.fc.weight, work.fc.weight)
    total = sum(t.nbytes for t in back.state_dict().values())
    slice_bytes = max(checkpoint.MIN_SLICE_BYTES, min(checkpoint.LOAD_PART_BYTES, total // checkpoint.LOAD_PARTS))
    assert len(seen) > table // slice_bytes  # the table went in slices
    # Never more than a slice mapped at once, and what the kernel maps around a read: the page
    # cache's folios of up to 2 MB, mapped whole (measured: up to 4 MB more for 1 MB slices, on a
    # 16 MB table). Copied whole, all 64 MB of the table were.
    assert max(seen) <= slice_bytes + (8 << 20), (max(seen), slice_bytes, table)
    assert _mapped_rss(os.path.realpath(pth)) < 64 << 10  # and the file is not left mapped


def test_a_non_finite_value_in_a_later_slice_fails_the_restore_by_name(tmp_path):
    _, ids, cfg, rec, pth = _big_table_checkpoint(tmp_path, poison=True)
    with pytest.raises(ValueError, match=r"'emb\.weight' holds 1 NaN/inf value"):
        amct.restore_compressed_retrain_model(BigTable(), ids, cfg, rec, pth, "state_dict", large_model=True)
