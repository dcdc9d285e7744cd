"""Benchmarks: every figure is a median, every claim a ratio measured in the same run."""
