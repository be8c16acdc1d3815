"""Upstream's module paths under ``amct_pytorch.common`` that user code imports from."""
