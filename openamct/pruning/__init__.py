"""Upstream's one-call structured pruning family (``amct.prune``): in place, from calibration data."""
