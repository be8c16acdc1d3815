"""One outlier in the first batch must not become a quantizer's clip."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import openamct as amct
from openamct.quant import clip_init
from openamct.quant.quantizers import ActULQ

CFG = "retrain_data_quant_config { ulq_quantize { } }\nretrain_weight_quant_config { arq_retrain { } }\n"


def test_one_outlier_in_the_first_batch_does_not_wreck_conv1(tmp_path, caplog):
    cfg = tmp_path / "q.cfg"
    cfg.write_text(CFG)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(4, 3, 16, 16)
    m = amct.create_quant_retrain_model(str(cfg), model, str(tmp_path / "r.txt"), x)
    first = torch.randn(4, 3, 16, 16)
    first[1, 2, 3, 4] = 1e6
    m.train()
    with caplog.at_level(logging.WARNING, logger="openamct.quant.clip_init"):
        m(first)
    aq = m[0].act_quant
    assert 2.0 < aq.clip_max.item() < 6.0, aq.clip_max.item()  # was 1.25e6
    assert -6.0 < aq.clip_min.item() < -1.0
    assert "1 of 3072 values lie far outside the rest" in caplog.text
    normal = torch.randn(4, 3, 16, 16)
    assert aq(normal).unique().numel() > 100  # a normal batch uses many levels (was 1)


@pytest.mark.parametrize("n", [1024, 1500, 10_000, 30_000, 1_000_000, 3_000_001])
@pytest.mark.parametrize("outliers", [1, 3])
def test_a_handful_of_outliers_is_ignored_at_every_batch_size(n, outliers):
    if outliers > clip_init.ignored_count(n):
        n = 1024 * outliers  # the smallest batch that ignores this many
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[:outliers] = 1e6
    x[-outliers:] = -1e6
    hi, lo = clip_init.percentile_max_min(x)
    assert 1.0 < hi < 7.0 and -7.0 < lo < -1.0, (hi, lo)
    q = ActULQ()
    q(x)
    assert q.clip_max.item() < 10.0 and q.clip_min.item() > -10.0


def test_clean_data_keeps_its_range_and_tiny_tensors_their_true_extremes():
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(1)) * 4.0
    hi, _ = clip_init.percentile_max_min(x)
    assert 3.99 < hi <= 4.0
    t = torch.tensor([0.5, -0.25, 9.0])
    assert clip_init.percentile_max_min(t) == (9.0, -0.25)  # under 1024 values nothing is ignored
    assert clip_init.ignored_count(10) == 0 and clip_init.ignored_count(8192) == 8 and clip_init.ignored_count(2048) == 2
    assert clip_init.ignored_count(20_000_000) == 19


def test_the_mse_of_each_candidate_is_the_quantizers_error_bit_for_bit():
    from openamct.quant import clip_init
    from openamct.quant.functions import LEVELS, QMAX, QMIN, SCALE_EPS

    torch.manual_seed(4)
    x = torch.cat([torch.randn(3000) * 3, torch.tensor([0.0, -0.0, 50.0, -50.0])])  # clipped both ways
    cmax = torch.linspace(0.5, 9.0, 61)
    cmin = -torch.linspace(0.0, 7.0, 61)
    got = clip_init._mse(x, cmax, cmin)
    scale = ((cmax - cmin) / LEVELS).clamp(min=SCALE_EPS)
    zp = torch.round(QMIN - cmin / scale).clamp(QMIN, QMAX)
    ref = torch.stack([((torch.round(x / s) + z).clamp(QMIN, QMAX) - z).mul(s).sub(x).square().mean()
                       for s, z in zip(scale, zp)])
    assert torch.equal(got, ref)


@pytest.mark.parametrize("case", ["normal", "ties", "max_in_tail", "inf", "nan", "relu6", "k_large"])
@pytest.mark.parametrize("largest", [True, False])
def test_the_extremes_are_topks_values_exactly(case, largest):
    """_extremes skips most of the values (block maxima bound the top k): it must still give
    topk's values, in its order, whatever the data."""
    from openamct.quant import clip_init

    gen = torch.Generator().manual_seed(len(case))
    n, k = 131072 + 777, 9  # a tail past the last whole block
    x = torch.randn(n, generator=gen)
    if case == "ties":
        x = torch.randint(-3, 4, (n,), generator=gen).float()
    elif case == "max_in_tail":
        x[-5:] = torch.tensor([50.0, -50.0, 40.0, -40.0, 45.0])
    elif case == "inf":
        x[[3, 90000]] = torch.tensor([float("inf"), float("-inf")])
    elif case == "nan":
        x[1234] = float("nan")
    elif case == "relu6":
        x = x.mul(4).clamp(0, 6)  # a quarter of the values equal the top one
    elif case == "k_large":
        k = 2000
    got = clip_init._extremes(x, k, largest)
    torch.testing.assert_close(got, torch.topk(x, k, largest=largest).values, rtol=0, atol=0, equal_nan=True)


def test_the_search_sample_holds_every_channel():
    from openamct.quant import clip_init

    tokens, channels = 300, 1024  # 307,200 values: a stride of 2 would keep the even channels only
    assert tokens * channels > clip_init.MAX_SEARCH_ELEMS
    sample = clip_init._subsample(torch.arange(tokens * channels, dtype=torch.float32).view(tokens, channels))
    assert sample.numel() <= clip_init.MAX_SEARCH_ELEMS
    assert set((sample.long() % channels).tolist()) == set(range(channels))
    assert sample.long().min() < channels and sample.long().max() >= (tokens - 1) * channels  # first and last token


def test_outlier_channels_at_odd_indices_widen_the_searched_clip():
    from openamct.quant import clip_init

    x = torch.randn(300, 1024, generator=torch.Generator().manual_seed(3))
    x[:, 1::64] *= 20  # 16 outlier channels, all odd, as in an LLM's hidden states
    hi, lo = clip_init.percentile_max_min(x)
    best_max, best_min = clip_init.search_clips(x, hi, lo, fixed_min=False)
    # Left out of the sample, the outliers would not count and the search would take the
    # tightest candidate (0.7 x the range), clipping all 16 channels.
    assert best_max > 0.9 * hi and best_min < 0.9 * lo


def test_one_outlier_in_a_small_first_batch_does_not_wreck_conv1(tmp_path, caplog):
    """768 values (4x3x8x8): too few for the fixed handful, yet the outlier is isolated."""
    cfg = tmp_path / "q.cfg"
    cfg.write_text(CFG)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    m = amct.create_quant_retrain_model(str(cfg), model, str(tmp_path / "r.txt"), torch.randn(4, 3, 8, 8))
    first = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    first[1, 2, 3, 4] = 1e6
    m.train()
    with caplog.at_level(logging.WARNING, logger="openamct.quant.clip_init"):
        m(first)
    aq = m[0].act_quant
    assert 1.0 < aq.clip_max.item() < 6.0, aq.clip_max.item()  # was 1.25e6
    assert "1 of 768 values lie far outside the rest" in caplog.text
    normal = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    assert aq(normal).unique().numel() >= 100  # was a single level


@pytest.mark.parametrize("n", [64, 200, 768, 1023])
def test_small_tensors_keep_their_extremes_unless_one_is_isolated(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert clip_init.percentile_max_min(x) == (max(float(x.max()), 0.0), min(float(x.min()), 0.0))
    sparse = torch.zeros(n)
    sparse[:3] = torch.tensor([1.0, 0.8, 0.5])  # a sparse ReLU output: its few values are the signal
    assert clip_init.percentile_max_min(sparse) == (1.0, 0.0)
    x[n // 2] = 1e6
    hi, _ = clip_init.percentile_max_min(x)
    assert hi < 5.0, hi
