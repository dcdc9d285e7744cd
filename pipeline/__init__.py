"""speclanes: a speculative-decoding serving pipeline.

The package in layers; imports point down only (tests/test_structure.py checks it):

    cli                 the `speclanes` command
    bench               benchmarks
    workers  orchestration  audit  api  service
                        lane cores; the orchestrator's core; the audit trail; the HTTP API;
                        supervisor and launch
    protocol            messages, transport, config, client
    decoding            sampling, acceptance, k control, speculation rules, step loop, drafters
    model  observability
                        the runtime (GGUF, tokenizer, prompts, backends, kernels); telemetry

The processes themselves are in `lanes/`, above all of this.

OpenBLAS reads its settings once, when numpy is first imported, so they are set here, before
anything in the package imports numpy: its default SkylakeX kernels were measured here at 2-4x
the cost of a one-row product for small row blocks, and the Haswell kernels do not have that
cliff. A user's own setting wins.
"""

import os

os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(min(2, os.cpu_count() or 1)))

__version__ = "0.1.0"
