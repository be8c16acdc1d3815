"""The whole 2:4 + INT8 lifecycle on random-weight Llama models of growing size.

create -> 5 training steps (the first computes the masks and initialises the clips; the steady
step is the median of the other four) -> eval forward (then two more, timed) -> record write -> save
in one process; then ORT load of both files, and restore from a checkpoint of the trained model,
each in a fresh process (as a resumed job would). Each step is timed, its peak RSS sampled (a thread reads
/proc/self/statm every 2 ms) and the memory it faulted in counted (minor faults: on a 2-core cloud VM whose host backs guest memory lazily a
fresh page costs 0.2-0.6 s/GB or, past the host's warm pages, 1.4-3.8 s/GB, so that column explains
most of a step's swings). Peaks are printed as "above what the process held when the step
began", divided by the model's weight bytes, so sizes compare directly, and as the process's
absolute peak. For reference, a plain FP32 training step and a plain float ``torch.onnx.export``
(same exporter and opset as save) run in separate processes, and so does the acceptance's
create -> eval forward -> save chain: memory a finished step freed would otherwise be reused by
the next one and hide its peak. The steady step's ratio to FP32's is taken from four more steps
of each, timed without the sampler (``_quiet_steps``); the first / steady ratio compares steps
that were both sampled. FP32 also trains a deep copy in a process that keeps the model it copied,
as ours does: on such VMs the first pages past a process's first GB or two cost several times
more, so that process, not FP32 alone, shows what the first step's memory costs any toolkit that
leaves the caller's model as it is; that process also times its plain ``copy.deepcopy``, the
reference for create's time (create copies first, and on such VMs the copy's new pages are most
of it at 1.1B). Another process runs ours with 1.5 W written and freed
just before its first step, so that the first step's new pages are ones the host still backs: a
diagnostic that separates the VM's first touch from openamct's one-time work. A last process
alternates steady steps of ours and of FP32 (docs/dev/platform.md: fake-quant training cost is measured
interleaved), pair by pair for about two minutes (6 to 40 pairs), so both ratios of the steady
step are printed: against FP32 in its own process, and interleaved, with the spread of the
pairs' ratios. The first step is also given in user CPU against a steady step's: on two busy
cores its page faults' wait is system CPU, so that ratio is the first step without the VM's
page cost (``memory_probe.py`` run on its own prints that cost as a process grows). The last line
prints each large-model target (docs/large-models.md) beside its figure.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py [--sizes 60m,250m] [--seq 64] [--threads 2] [--large on]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py --sizes 1.1b --allow-1b   # needs ~20 GB

``--large`` sets the large-model switch (``large_model`` of create_*/restore_*, docs/large-models.md):
``on`` and ``off`` compare what the machinery buys at one size. Random weights, eager attention,
no downloads. Timings on a shared machine are noisy: compare
ratios measured in one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.memory_probe import Peak, first_touch_seconds_per_gb, rss  # noqa: E402
from benchmarks.scale_report import print_growth, report  # noqa: E402

SIZES = {  # name -> LlamaConfig arguments (untied head, vocab 32000)
    "60m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=8),
    "250m": dict(hidden_size=1024, intermediate_size=2304, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=16),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4),  # TinyLlama's shape
}

CFG = ("retrain_data_quant_config { ulq_quantize { dst_type: INT8 } }\n"
       "retrain_weight_quant_config { arq_retrain { dst_type: INT8 channel_wise: true } }\n"
       "prune_config { n_out_of_m_pruner { l1_selective_prune { n_out_of_m_type: M4N2 update_freq: 0 } } }\n")

def build(size: str, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False,
                      use_cache=False, attn_implementation="eager", **SIZES[size])
    return LlamaForCausalLM(cfg)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def inputs(seq: int) -> dict:
    """Token ids and an all-ones attention mask: without a mask, transformers looks for packed
    sequences with ``torch.diff``, which the ONNX exporter cannot convert."""
    import torch

    return {"input_ids": torch.randint(0, 32000, (1, seq)), "attention_mask": torch.ones(1, seq, dtype=torch.int64)}

STEPS = 5  # training steps per run: the first, then four whose median is the steady step


def _step(model, x, opt):
    out = model(**x)
    logits = out["logits"] if isinstance(out, dict) else out.logits
    loss = logits.float().logsumexp(-1).mean()  # any scalar that touches every output
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _setup(size: str, seq: int, folder: str):
    """The caller's model, its inputs, and the config and record paths in ``folder``."""
    cfg = os.path.join(folder, "cfg.cfg")
    with open(cfg, "w") as f:
        f.write(CFG)
    return build(size), inputs(seq), cfg, os.path.join(folder, "record.txt")


def run_lifecycle(size: str, seq: int, folder: str, large: bool | None = None) -> dict:
    import torch

    import openamct as amct

    model, ids, cfg, rec = _setup(size, seq, folder)
    out = {"params": sum(p.numel() for p in model.parameters()), "weights": weight_bytes(model),
           "base_rss": rss()}
    with Peak() as p:
        work = amct.create_compressed_retrain_model(model, ids, cfg, rec, large_model=large)
    out["create"] = p.row()
    work.train()
    opt = torch.optim.SGD([q for q in work.parameters() if q.requires_grad], lr=1e-4)
    out.update(_sampled_steps(work, ids, opt, "train"))
    work._openamct.wait()  # the first step's record write, done in the background
    out["quiet"] = _quiet_steps(work, ids, opt)
    out["record_after_train"] = os.path.getsize(rec)
    work.eval()
    with Peak() as p, torch.no_grad():
        work(**ids)
    out["eval"] = p.row()
    out["eval_again"] = _timed_evals(work, ids, EVALS - 1)
    out["record_after_eval"] = os.path.getsize(rec)
    keeper = work._openamct
    keeper._last = None  # forget the last write, so flush builds and writes the record again
    with Peak() as p:
        keeper.flush()
    out["record_write"] = p.row()
    out["mask_file"] = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if ".masks-" in f)
    prefix = os.path.join(folder, "llama")
    with Peak() as p:
        amct.save_compressed_retrain_model(work, rec, prefix, ids)
    out["save"] = p.row()
    files = sorted(f for f in os.listdir(folder) if f.startswith("llama"))
    out["files"] = {f: os.path.getsize(os.path.join(folder, f)) for f in files}
    torch.save(work.state_dict(), os.path.join(folder, "ckpt.pth"))  # for the restore part
    return out


EVALS = 3  # eval forwards: the first (timed with its peak), then more, each timed on its own


def _timed_evals(model, ids, n: int) -> list[float]:
    """Seconds of ``n`` more eval forwards: one eval forward of the 1.1B model took 1.34-4.97 s
    across runs, so growth is also given from the median of all of them."""
    import torch

    times = []
    with torch.no_grad():
        for _ in range(n):
            t = time.perf_counter()
            model(**ids)
            times.append(time.perf_counter() - t)
    return times


def run_ort_load(size: str, seq: int, folder: str, large: bool | None = None) -> dict:
    """Both saved files loaded by ONNX Runtime, each in turn, in a fresh process."""
    import onnxruntime as ort

    with Peak() as p:
        for f in sorted(os.listdir(folder)):
            if f.startswith("llama") and f.endswith(".onnx"):
                ort.InferenceSession(os.path.join(folder, f), providers=["CPUExecutionProvider"])
    return {"ort_load": p.row()}


def run_restore(size: str, seq: int, folder: str, large: bool | None = None) -> dict:
    """Restore from the lifecycle's record and checkpoint in a fresh process, as a resumed job
    does; its peak above the caller's freshly built model."""
    import openamct as amct

    model = build(size)
    ids = inputs(seq)
    with Peak() as p:
        amct.restore_compressed_retrain_model(model, ids, os.path.join(folder, "cfg.cfg"),
                                              os.path.join(folder, "record.txt"), os.path.join(folder, "ckpt.pth"),
                                              large_model=large)
    return {"restore": p.row()}


def run_chain(size: str, seq: int, folder: str, large: bool | None = None) -> dict:
    """create -> eval forward -> save in a fresh process: the acceptance's chain, its peak
    above what the process held with the caller's model built."""
    import torch

    import openamct as amct

    model, ids, cfg, rec = _setup(size, seq, folder)
    with Peak() as p:
        work = amct.create_compressed_retrain_model(model, ids, cfg, rec, large_model=large)
        work.eval()
        with torch.no_grad():
            work(**ids)
        amct.save_compressed_retrain_model(work, rec, os.path.join(folder, "llama"), ids)
    return {"chain": p.row()}


def run_steps(size: str, seq: int, folder: str, large: bool | None = None) -> dict:
    import torch

    model = build(size)
    ids = inputs(seq)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model.train()
    out = _sampled_steps(model, ids, opt, "fp32_step")
    out["fp32_quiet"] = _quiet_steps(model, ids, opt)
    return out


def run_copy_steps(size: str, seq: int, folder: str, large: bool | None = None) -> dict:
    """Plain FP32 training of a deep copy while the caller's model stays held: what a toolkit
    that never edits the caller's model holds before its first step, without compressing
    anything. On VMs whose host backs memory lazily the pages a process touches past its first
    GB or two cost several times more, so this, and not FP32 alone, is the
    reference that shows how much of our first step is memory any such toolkit pays for."""
    import copy

    import torch

    model = build(size)
    ids = inputs(seq)
    with Peak() as p:  # also the reference for create's time: its copy, nothing else
        work = copy.deepcopy(model)
    work.train()
    opt = torch.optim.SGD(work.parameters(), lr=1e-4)
    return {"deepcopy": p.row(), **_sampled_steps(work, ids, opt, "copy_step")}


def run_warm_first(size: str, seq: int, folder: str, large: bool | None = None) -> dict:
    """Ours again, with 1.5 W written and freed just before the first step: the guest kernel
    hands those pages back while the host still backs them, so this first step pays what a
    machine without lazy host memory would for its new pages. A diagnostic beside
    the real first step (the lifecycle's), not a replacement: it splits the first step's excess
    into the VM's first touch and openamct's one-time work (masks, clip search, record)."""
    import torch

    import openamct as amct

    model, ids, cfg, rec = _setup(size, seq, folder)
    work = amct.create_compressed_retrain_model(model, ids, cfg, rec, large_model=large)
    work.train()
    opt = torch.optim.SGD([q for q in work.parameters() if q.requires_grad], lr=1e-4)
    warm = torch.ones(int(1.5 * weight_bytes(model)) // 4)
    del warm
    out = _sampled_steps(work, ids, opt, "warm_step")
    work._openamct.wait()
    return out


def _sampled_steps(model, ids, opt, prefix: str) -> dict:
    """STEPS training steps, each timed with its peak RSS, faults and CPU sampled."""
    out = {}
    for i in range(1, STEPS + 1):
        with Peak() as p:
            _step(model, ids, opt)
        out[f"{prefix}{i}"] = p.row()
        out[f"{prefix}{i}_cpu"] = p.cpu
    return out


def _quiet_steps(model, ids, opt) -> list[float]:
    """Seconds of STEPS - 1 more steps, timed without the RSS sampler: its thread takes the GIL
    every 2 ms, which slowed our steps (three times FP32's ops) by ~10 % and FP32's by ~5 %
    (250M, measured side by side), so the steady-step ratio is taken from these."""
    times = []
    for _ in range(STEPS - 1):
        t = time.perf_counter()
        _step(model, ids, opt)
        times.append(time.perf_counter() - t)
    return times


INTERLEAVED = (6, 40, 120.0)  # pairs of steady steps, ours and FP32: at least, at most, seconds to stop adding


def run_interleaved(size: str, seq: int, folder: str, large: bool | None = None) -> dict:
    """Steady steps of ours and of plain FP32, alternating in one process (docs/dev/platform.md:
    fake-quant training cost is measured this way): both see the same moment of the machine, whose
    speed drifts by tens of percent between processes minutes apart on a shared VM. The caller's
    model trains in FP32, its compressed copy as ours; each first step is left out."""
    import torch

    import openamct as amct

    model, ids, cfg, rec = _setup(size, seq, folder)
    work = amct.create_compressed_retrain_model(model, ids, cfg, rec, large_model=large)
    runs = {}
    for name, m in (("ours", work), ("fp32", model)):
        m.train()
        runs[name] = (m, torch.optim.SGD([q for q in m.parameters() if q.requires_grad], lr=1e-4))
        _step(m, ids, runs[name][1])
    work._openamct.wait()  # the first step's record write
    # Pairs until the minimum and the time are both reached: a shared VM switches between fast and
    # slow spells lasting 5-20 steps (60M: ours 0.25 s in one, 0.45 s in the next, nothing else
    # running), so six pairs can land in one spell. The pair's order alternates, so that neither
    # always runs on the memory and caches the other left.
    least, most, budget = INTERLEAVED
    times = {name: [] for name in runs}
    start = time.perf_counter()
    for i in range(most):
        if i >= least and time.perf_counter() - start > budget:
            break
        for name in (("ours", "fp32") if i % 2 == 0 else ("fp32", "ours")):
            m, opt = runs[name]
            t = time.perf_counter()
            _step(m, ids, opt)
            times[name].append(time.perf_counter() - t)
    return {"interleaved": times}


def run_export(size: str, seq: int, folder: str, large: bool | None = None) -> dict:
    """A plain float export in a fresh process (after training steps the allocator would
    already hold memory the export reuses, and its peak would look smaller)."""
    import warnings

    import torch

    model = build(size).eval()
    ids = inputs(seq)
    with Peak() as p, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (), kwargs=ids, f=os.path.join(folder, "plain.onnx"), dynamo=False, opset_version=17,
                          do_constant_folding=True)
    return {"plain_export": p.row()}


LARGE = {"on": True, "off": False, "auto": None}  # --large -> large_model

PARTS = {"lifecycle": run_lifecycle, "ort_load": run_ort_load, "restore": run_restore, "chain": run_chain,
         "steps": run_steps, "copy_steps": run_copy_steps, "warm_first": run_warm_first, "export": run_export, "interleaved": run_interleaved}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.folder:  # the lifecycle's files, read by the parts after it
        print("RESULT " + json.dumps(PARTS[args.part](args.size, args.seq, args.folder, LARGE[args.large])),
              flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="openamct-scale-") as folder:
        print("RESULT " + json.dumps(PARTS[args.part](args.size, args.seq, folder, LARGE[args.large])), flush=True)


def spawn(part: str, size: str, args, folder: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--size", size, "--seq", str(args.seq),
           "--threads", str(args.threads), "--large", args.large] + (["--folder", folder] if folder else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{part} {size} failed (rc {proc.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="60m", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--allow-1b", action="store_true", help="run 1.1b (about 20 GB peak: not on a shared machine)")
    ap.add_argument("--large", choices=tuple(LARGE), default="auto",
                    help="the large-model switch, create_*/restore_*'s large_model: on, off, or auto (default: "
                         "taken from 200M parameters)")
    ap.add_argument("--part", choices=tuple(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        child(args)
        return
    sizes = args.sizes.split(",")
    for size in sizes:
        if size not in SIZES:
            raise SystemExit(f"--sizes: unknown size {size!r} (choose from {', '.join(SIZES)})")
        if size == "1.1b" and not args.allow_1b:
            raise SystemExit("--sizes 1.1b needs --allow-1b (about 20 GB of memory)")
    fresh, again = first_touch_seconds_per_gb()
    print(f"memory: writing fresh pages {fresh:.2f} s/GB, the same pages again {again:.2f} s/GB")
    results = {}
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="openamct-scale-") as folder:
            life = {k: v for part in ("lifecycle", "ort_load", "restore") for k, v in
                    spawn(part, size, args, folder).items()}
        plain = {k: v for part in ("chain", "steps", "copy_steps", "warm_first", "export", "interleaved") for k, v in spawn(part, size, args).items()}
        results[size] = (life, plain)
        report(size, life, plain)
    print_growth(sizes, results)

if __name__ == "__main__":
    main()
