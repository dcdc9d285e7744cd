"""Running a pipeline: `supervisor` (starts, watches, restarts and stops the processes) and
`launch` (start one in the background and wait until it is ready: for the CLI, the benchmarks
and the tests)."""
