"""speclanes: a speculative-decoding serving pipeline.

OpenBLAS reads its settings once, when numpy is first imported, so they are set
here, before anything in the package imports numpy. FINDINGS.md measured the
default SkylakeX kernels at 2-4x the cost of a one-row product for small row
blocks; the Haswell kernels do not have that cliff. A user's own setting wins.
"""

import os

os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(min(2, os.cpu_count() or 1)))

__version__ = "0.1.0"
