"""The test suite. This runs before any test module or conftest imports `pipeline` (which sets its
OpenBLAS default), so it sees whether the user set OpenBLAS's or OpenMP's threads
(conftest.pytest_configure)."""

import os

USER_OPENBLAS_THREADS = os.environ.get("OPENBLAS_NUM_THREADS")
USER_OMP_THREADS = os.environ.get("OMP_NUM_THREADS")
