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

The native kernels' OpenMP threads (libgomp) read theirs when libgomp loads. By default a thread
that reaches a barrier first spins up to 300,000 pauses (about 9 ms here) before it sleeps. A
forward has about 150 barriers, and on cores shared with other processes the thread it waits
for is often descheduled: at load 6-8 on the 2-core VM a one-row forward took 109 ms (median)
that way against 41 ms with the spin cut to 1,000 pauses. 1,000 was too short for a quiet
machine's verify blocks, whose gaps between regions let the second thread fall asleep and pay a
wake-up: on the 2-core Xeon VM, default model, 512-token cache, 5,000 pauses (about 0.15 ms) took
T=8 from 13.9 to 10.9 ms and T=16 from 20.5 to 17.1 ms, quiet; beside 6 busy processes T=1 was
unchanged (43.7 -> 44.0 ms) and T=8 82.6 -> 61.6 ms. A process whose forward is done still gives
its second core back to the other lanes within a fraction of a millisecond.
"""

import os

os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(min(2, os.cpu_count() or 1)))
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "5000")

__version__ = "0.1.0"
