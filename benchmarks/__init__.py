"""The benchmark scripts' models (``benchmarks.models``), importable with the repository root on
``sys.path``; the scripts themselves run as files."""
