"""Sampling: per-row parameters, the fixed-shape sampler and its step, grammar masks."""
