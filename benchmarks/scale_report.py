"""What ``scale.py`` prints: each size's table and ratios, and the growth from size to size.

The parts' results are dicts of rows ``(seconds, peak above the start, absolute peak, faulted
bytes)`` keyed by step name (``train1``.. ``trainN``, ``fp32_step1``.., ``eval``, ``save``...), as
``scale.py``'s child processes return them; the step counts are read from those keys.
"""

from __future__ import annotations

import statistics


def _count(src: dict, prefix: str) -> int:
    """How many numbered steps ``prefix1``, ``prefix2``... a part timed."""
    return sum(1 for k in src if k.startswith(prefix) and k[len(prefix):].isdigit())


def _steady(src: dict, prefix: str) -> float:
    """The steady step: the median of every timed step but the first."""
    return statistics.median(src[f"{prefix}{i}"][0] for i in range(2, _count(src, prefix) + 1))


def _step_rows(src: dict, prefix: str) -> list[tuple[str, dict]]:
    return [(f"{prefix}{i}", src) for i in range(1, _count(src, prefix) + 1)]


def _evals(life: dict) -> list[float]:
    return [life["eval"][0], *life["eval_again"]]


def report(size: str, life: dict, plain: dict) -> None:
    w = life["weights"]
    print(f"\n== {size}: {life['params'] / 1e6:.0f}M params, weights {w / 1e9:.2f} GB, "
          f"process held {life['base_rss'] / 1e9:.2f} GB before create")
    print(f"{'step':<14}{'time s':>9}{'peak+ GB':>10}{'peak+/W':>9}{'peak GB':>9}{'faulted GB':>12}")
    rows = [("create", life), *_step_rows(life, "train"), ("eval", life), ("record_write", life), ("save", life),
            ("ort_load", life), ("restore", life), ("chain", plain), *_step_rows(plain, "fp32_step"),
            ("deepcopy", plain), *_step_rows(plain, "copy_step"), *_step_rows(plain, "warm_step"), ("plain_export", plain)]
    for key, src in rows:
        s, b, peak, faulted = src[key]
        print(f"{key:<14}{s:>9.2f}{b / 1e9:>10.2f}{b / w:>9.2f}{peak / 1e9:>9.2f}{faulted / 1e9:>12.2f}")
    steady, fp32 = _steady(life, "train"), _steady(plain, "fp32_step")  # sampled, as the first
    quiet, fp32_quiet = statistics.median(life["quiet"]), statistics.median(plain["fp32_quiet"])
    first = life["train1"][0]
    # What the first step costs beyond a steady one, ours against FP32's own (its gradients'
    # first pages): the difference is the first step's one-time work (masks, clip search, record).
    extra, fp32_extra = first - steady, plain["fp32_step1"][0] - fp32
    print(f"record: {life['record_after_train'] / 1e6:.1f} MB after training, {life['record_after_eval'] / 1e6:.1f} MB "
          f"after eval, mask file {life.get('mask_file', 0) / 1e6:.1f} MB; files: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in life["files"].items()))
    print(f"first step: {first:.2f} s = steady {steady:.2f} s + {extra:.2f} s; FP32's first step is its steady one "
          f"+ {fp32_extra:.2f} s; one-time work {extra - fp32_extra:.2f} s = {(extra - fp32_extra) / steady:.2f} x the "
          f"steady step")
    print(f"eval forwards: the first {life['eval'][0]:.2f} s, then " + ", ".join(f"{t:.2f}" for t in life["eval_again"])
          + f" s; median {statistics.median(_evals(life)):.2f} s")
    print(f"create: {life['create'][0]:.2f} s; a plain copy.deepcopy of the model (the copy create makes before "
          f"anything else): {plain['deepcopy'][0]:.2f} s, faulted {plain['deepcopy'][3] / 1e9:.2f} GB")
    inter = {k: statistics.median(v) for k, v in plain["interleaved"].items()}
    copy_steady = _steady(plain, "copy_step")
    copy_first = plain["copy_step1"][0]
    cpu = {k: plain.get(f"{k}_cpu") or life.get(f"{k}_cpu")
           for k in ("train1", "train2", "fp32_step1", "copy_step1", "warm_step1")}
    print("first steps' CPU (user / system s; system time is mostly page faults): " + ", ".join(
        f"{k} {v[0]:.2f} / {v[1]:.2f}" for k, v in cpu.items() if v))
    print(f"FP32 training a deep copy with the caller's model held (the memory ours holds): first {copy_first:.2f} s, "
          f"steady {copy_steady:.2f} s, first / steady {copy_first / copy_steady:.2f}; our first step's excess over "
          f"its first step's excess: {extra - (copy_first - copy_steady):.2f} s")
    warm_first = plain["warm_step1"][0]
    warm_steady = _steady(plain, "warm_step")
    print(f"ours with 1.5 W written and freed just before the first step (pages the host still backs): first "
          f"{warm_first:.2f} s (system {plain['warm_step1_cpu'][1]:.2f} s), steady {warm_steady:.2f} s, first / steady "
          f"{warm_first / warm_steady:.2f}; the lifecycle's first step took {first - warm_first:.2f} s more (the VM's "
          f"first touch of new pages, and noise)")
    # On 2 busy cores a page fault's wait is system CPU taken from the step's compute: the ratio in
    # user CPU is the first step without the VM's page cost, the rest is what its pages cost here.
    user_steady = statistics.median(life[f"train{i}_cpu"][0] for i in range(2, _count(life, "train") + 1))
    user_ratio = life["train1_cpu"][0] / user_steady
    sys_first, faulted = life["train1_cpu"][1], life["train1"][3]
    print(f"first step in user CPU: {life['train1_cpu'][0]:.2f} s against a steady step's {user_steady:.2f} s, "
          f"{user_ratio:.2f} x; its system CPU {sys_first:.2f} s for {faulted / 1e9:.2f} GB of new pages "
          f"({sys_first / max(faulted / 1e9, 1e-9):.2f} s/GB)")
    pairs = [a / b for a, b in zip(plain["interleaved"]["ours"], plain["interleaved"]["fp32"])]
    q1, _, q3 = statistics.quantiles(pairs, n=4, method="inclusive")
    print(f"interleaved in one process ({len(pairs)} pairs, medians): ours {inter['ours']:.2f} s, FP32 "
          f"{inter['fp32']:.2f} s, ratio {inter['ours'] / inter['fp32']:.2f}; each pair's ratio: median "
          f"{statistics.median(pairs):.2f}, quartiles {q1:.2f}-{q3:.2f}")
    print(f"steady steps without the RSS sampler (medians of {len(life['quiet'])}): ours {quiet:.2f} s, FP32 {fp32_quiet:.2f} s; "
          f"with it: ours {steady:.2f} s, FP32 {fp32:.2f} s")
    print(f"ratios: steady step / FP32 step {quiet / fp32_quiet:.2f}, first / steady {first / steady:.2f}, "
          f"save / plain export {life['save'][0] / plain['plain_export'][0]:.2f}, "
          f"save peak+ - plain export peak+ = {(life['save'][1] - plain['plain_export'][1]) / w:.2f} W")
    print(f"acceptance: create peak+ {life['create'][1] / w:.2f} W (<= 1.3); chain peak+ - plain export peak+ = "
          f"{(plain['chain'][1] - plain['plain_export'][1]) / w:.2f} W (<= 1.3); save / plain export "
          f"{life['save'][0] / plain['plain_export'][0]:.2f} (<= 2); steady / FP32 {quiet / fp32_quiet:.2f} (fresh "
          f"processes), {inter['ours'] / inter['fp32']:.2f} (interleaved) (<= 1.3); "
          f"first / steady {first / steady:.2f} (<= 2; in user CPU {user_ratio:.2f}; FP32's own first / steady "
          f"{plain['fp32_step1'][0] / fp32:.2f}, FP32 training a copy {copy_first / copy_steady:.2f}, ours on warmed "
          f"pages {warm_first / warm_steady:.2f}); record write "
          f"{life['record_write'][0] / (life['params'] / 1e9):.2f} s per 1e9 params (<= 1)")


def print_growth(sizes: list[str], results: dict) -> None:
    """Time and peak growth over parameter growth between consecutive sizes."""
    for a, b in zip(sizes, sizes[1:]):
        (la, pa), (lb, pb) = results[a], results[b]
        grow = lb["params"] / la["params"]
        print(f"\ngrowth {a} -> {b} ({grow:.1f}x params), time growth / param growth: " + ", ".join(
            f"{k} {lb[k][0] / la[k][0] / grow:.2f}"
            for k in ("create", "train1", f"train{_count(lb, 'train')}", "eval", "save"))
            + f"; eval, median of {len(_evals(lb))} "
            + f"{statistics.median(_evals(lb)) / statistics.median(_evals(la)) / grow:.2f}"
            + f"; a plain copy.deepcopy {pb['deepcopy'][0] / pa['deepcopy'][0] / grow:.2f}")
        # A peak under 1% of the weights is noise (a step that reused freed memory): no ratio.
        print(f"growth {a} -> {b}, peak+ growth / param growth: " + ", ".join(
            f"{k} {lb[k][1] / la[k][1] / grow:.2f}" if la[k][1] > 0.01 * la["weights"] else f"{k} -"
            for k in ("create", "train1", "eval", "save")))

