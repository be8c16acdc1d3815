"""The `openamct` command: demo | inspect | verify | report | prune-search. The CLI is the only place that prints."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-shape must be comma-separated ints like 1,3,224,224, got {text!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"--input-shape dims must be positive, got {text!r}")
    return dims


def _load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"openamct: --model must look like package.module:factory, got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"openamct: cannot load --model {spec!r}: {exc}") from None
    return factory


def _print_result(command: str, compute, errors: tuple[type[BaseException], ...], fmt) -> int:
    """Print ``fmt(compute())``; a user error (``errors``) is one line on stderr and exit code 2."""
    try:
        result = compute()
    except errors as exc:
        print(f"openamct {command}: {exc}", file=sys.stderr)
        return 2
    print(fmt(result))
    return 0


_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool")


def _named_input(text: str) -> tuple[str, str, tuple[int, ...]]:
    """``name:dtype:shape``, e.g. ``input_ids:int64:1,128``."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[0] or parts[1] not in _DTYPES:
        raise argparse.ArgumentTypeError(f"--input must be name:dtype:shape with dtype one of {', '.join(_DTYPES)}, "
                                         f"e.g. input_ids:int64:1,128; got {text!r}")
    return parts[0], parts[1], _shape(parts[2])


def _example_inputs(args: argparse.Namespace, returned):
    """The model and its example inputs: from the factory's (model, inputs), from --input
    (floats ~ N(0, 1); integers and booleans 1, valid as token ids and attention masks) or
    from --input-shape (one float tensor)."""
    import torch

    model, inputs = (returned if isinstance(returned, tuple) and len(returned) == 2 else (returned, None))
    given = sum(x is not None and x != [] for x in (inputs, args.input, args.input_shape))
    if given != 1:
        raise SystemExit("openamct inspect: give the example inputs one way: --input-shape, --input (repeatable), "
                         "or a --model factory that returns (model, example_inputs)")
    torch.manual_seed(0)
    if args.input_shape:
        return model, torch.randn(*args.input_shape)
    if args.input:
        feeds = {}
        for name, dtype, shape in args.input:
            dt = getattr(torch, dtype)
            feeds[name] = torch.randn(*shape).to(dt) if dt.is_floating_point else torch.ones(*shape, dtype=dt)
        return model, feeds
    return model, inputs


def cmd_inspect(args: argparse.Namespace) -> int:
    from openamct.inspection import format_inspection, inspect_model

    model, x = _example_inputs(args, _load_factory(args.model)())
    return _print_result("inspect", lambda: inspect_model(model, x, args.config, args.api),
                         (ValueError, TypeError), format_inspection)


def _fp32_from_factory(spec: str, args: argparse.Namespace, folder: str) -> str:
    """Export ``--fp32-model``'s model to ``folder`` on a random input of ``--input-shape``."""
    import torch

    from openamct.export.fp32_reference import write_fp32

    model = _load_factory(spec)()
    if isinstance(model, tuple) and len(model) == 2:
        model = model[0]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--fp32-model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    shape = list(args.input_shape)
    if args.batch is not None:
        shape[0] = args.batch
    path = os.path.join(folder, "fp32_model.onnx")
    write_fp32(model, path, torch.randn(*shape), None)
    return path


def cmd_verify(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from openamct.export.verify import format_verification, verify_files

    if args.fp32 and args.fp32_model:
        print("openamct verify: give the FP32 model one way: --fp32 FILE or --fp32-model package.module:factory",
              file=sys.stderr)
        return 2

    def compute():
        with tempfile.TemporaryDirectory(prefix="openamct-verify-") as tmp:
            fp32 = _fp32_from_factory(args.fp32_model, args, tmp) if args.fp32_model else args.fp32
            return verify_files(args.files, args.input_shape, fp32_path=fp32, batch=args.batch, runs=args.runs,
                                samples=args.samples)

    return _print_result("verify", compute, (ValueError, TypeError, OSError),
                         (lambda r: json.dumps(r, indent=2)) if args.json else format_verification)


def cmd_report(args: argparse.Namespace) -> int:
    from openamct.record_summary import format_report, report_record

    return _print_result("report", lambda: report_record(args.record), (ValueError,),
                         lambda report: format_report(report, as_json=args.json))


@contextlib.contextmanager
def _messages_to_stdout(logger_name: str):
    """Show a module's INFO messages on stdout as plain lines while the block runs."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger(logger_name)
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # with --verbose the root handler would repeat every line on stderr
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def cmd_demo(args: argparse.Namespace) -> int:
    from openamct.demo.report import format_summary
    from openamct.demo.run import DemoError, run

    def compute():
        with _messages_to_stdout("openamct.demo.run"):
            return run(args.out, args.config, args.epochs)

    return _print_result("demo", compute, (DemoError,), lambda results: format_summary(results, args.out))


def cmd_prune_search(args: argparse.Namespace) -> int:
    from openamct.cli_search import search_from_cli

    return _print_result("prune-search", lambda: search_from_cli(args, _load_factory), (ValueError, TypeError),
                         lambda text: text)


def _verbose(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log at INFO level, progress included (default: warnings only)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openamct", description="AMCT-compatible retrain compression for PyTorch. "
                                "Each command's options: openamct COMMAND --help")
    _verbose(p, False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=text, description=text)
        _verbose(c, argparse.SUPPRESS)  # also after the command: openamct inspect -v ...
        return c

    d = command("demo", "compress a real MNIST CNN end to end and write a report")
    d.add_argument("--out", default="demo-out", help="folder for the ONNX files, report.md and the chart "
                   "(default: demo-out)")
    d.add_argument("--config", default=None, help="retrain config (.cfg) (default: demo.cfg of openamct.demo)")
    d.add_argument("--epochs", type=int, default=None,
                   help="epochs for FP32 training and for retraining (default: 15 and 12)")
    d.set_defaults(func=cmd_demo)

    i = command("inspect", "show what a config does to a model, layer by layer, before training")
    i.add_argument("--model", required=True,
                   help="package.module:factory returning the model, or (model, example_inputs) (required)")
    i.add_argument("--input-shape", type=_shape, help="one float input, e.g. 1,3,224,224 (default: none; give the "
                   "inputs one way: this, --input, or a factory returning them)")
    i.add_argument("--input", action="append", type=_named_input, default=[],
                   help="a keyword input name:dtype:shape, repeatable, e.g. input_ids:int64:1,128 (default: none)")
    i.add_argument("--config", required=True, help="retrain config (.cfg) (required)")
    i.add_argument("--api", choices=("prune", "compressed", "quant"), default="compressed",
                   help="whose rules apply: prune = create_prune_retrain_model, compressed = "
                        "create_compressed_retrain_model, quant = create_quant_retrain_model (default: compressed)")
    i.set_defaults(func=cmd_inspect)

    v = command("verify", "is the deploy model faster than FP32, and does it agree with it and with fake-quant?")
    v.add_argument("files", nargs="+", metavar="ONNX",
                   help="the deploy file, and the fake-quant file of the same save and/or an FP32 export, in any "
                        "order: each is recognised by its content (the deploy file holds the integer weights)")
    v.add_argument("--fp32", default=None, help="an FP32 ONNX export of the model you compressed, e.g. the "
                   "{save_path}_fp32_model.onnx that save_*(..., fp32_model=model) writes (default: none)")
    v.add_argument("--fp32-model", default=None, metavar="PKG.MOD:FACTORY",
                   help="package.module:factory returning the FP32 model, exported here (default: none)")
    v.add_argument("--input-shape", required=True, type=_shape,
                   help="the first input's shape, e.g. 1,3,224,224; inputs are random (required)")
    v.add_argument("--batch", type=int, default=None, help="override the first dim of --input-shape (default: as given)")
    v.add_argument("--runs", type=int, default=20, help="timed runs per model, interleaved (default: 20)")
    v.add_argument("--samples", type=int, default=16, help="random inputs the agreement is measured on (default: 16)")
    v.add_argument("--json", action="store_true", help="print the result as JSON (default: text)")
    v.set_defaults(func=cmd_verify)

    r = command("report", "summarise a record file, layer by layer")
    r.add_argument("record", help="the record file (record_file of create_*)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON (default: a table)")
    r.set_defaults(func=cmd_report)

    s = command("prune-search", "choose per-layer filter-prune ratios for a MACs or latency budget")
    s.add_argument("--model", required=True, help="package.module:factory returning the model (required)")
    s.add_argument("--config", required=True, help="AutoChannelPruneConfig (.cfg): compress_ratio, ... (required)")
    s.add_argument("--out", required=True, help="the retrain config to write, e.g. found.cfg (required)")
    s.add_argument("--weights", default=None, help="state dict (.pth, torch.save) to load into the model "
                   "(default: the factory's weights)")
    s.add_argument("--data", default=None,
                   help="package.module:factory returning a list of [data, label] batches (default: none)")
    s.add_argument("--input-shape", type=_shape, default=None,
                   help="without --data: random batches of this shape, labelled with the model's own predictions "
                        "(default: none)")
    s.add_argument("--batches", type=int, default=1, help="random batches to make without --data (default: 1)")
    s.add_argument("--budget", choices=("macs", "latency"), default="macs",
                   help="what compress_ratio divides: MACs, or ONNX Runtime latency on this CPU (default: macs)")
    s.add_argument("--chart", default=None, help="also write the report as a PNG chart here (default: none)")
    s.add_argument("--json", action="store_true", help="print the report as JSON (default: a table)")
    s.set_defaults(func=cmd_prune_search)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped early (openamct report ... | head): what it read is what it wanted.
        # Point stdout at nothing so the interpreter's flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
