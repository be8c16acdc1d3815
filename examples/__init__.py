"""The example scripts' shared helpers (``examples.digits``, ``examples.minilm_helpers``), importable
with the repository root on ``sys.path``; the scripts themselves run as files."""
