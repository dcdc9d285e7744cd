"""Benchmarks: every figure is a median, every claim a ratio measured in the same run.
One module per `speclanes bench` command, each declaring its own flags (`add_parser`);
shared helpers in `common` (workloads, private pipelines, CPU accounting) and `flags`."""
