"""Position-keyed random numbers: the uniform that decides sequence position i of a request is a
pure function of (request seed, i, purpose).

A counter-based generator (Philox, keyed by the seed, its counter set to the position and the
purpose) computes it, so it never depends on how many numbers were drawn before. That is what
makes seeded speculation identical to plain seeded decoding: with a deterministic drafter the
target samples each position with that position's own number, whatever the drafter proposed,
whatever k the controller chose, whatever the suffix cache held, across lane restarts, in-process
or through the pipeline. `audit verify` re-derives every recorded number the same way.
"""

from __future__ import annotations

import threading

import numpy as np

# What a number decides at a position. Each purpose has its own counter, so no two uses share one.
SAMPLE = 0  # the target's own sample (plain decoding, a bonus token, a deterministic draft's verdict)
ACCEPT = 1  # keep a sampled draft with probability min(1, q/p) (the model drafter)
RESIDUAL = 2  # the replacement drawn from norm(max(0, q - p)) after such a draft is rejected
DRAFT = 3  # the model drafter's own sample of its proposal
PURPOSES = {"sample": SAMPLE, "accept": ACCEPT, "residual": RESIDUAL, "draft": DRAFT}


_thread = threading.local()  # this thread's generator, for `uniform`


def uniform(seed: int, position: int, purpose: int) -> float:
    """The number in [0, 1) for (seed, position, purpose): the first double of a Philox stream
    whose key is the seed and whose counter starts at (position, purpose).

    One generator per thread is set to that key and counter, rather than a new one built: a new
    `Philox` draws OS entropy for a seed its key then replaces, and took about 0.1 ms of every
    sampled row between two forwards (the same numbers: `test_sampling`)."""
    if not 0 <= seed < 2**64 or position < 0:
        raise ValueError(f"seed must be in [0, 2**64) and position >= 0, got {seed}, {position}")
    generator = getattr(_thread, "generator", None)
    if generator is None:
        generator = _thread.generator = np.random.Generator(np.random.Philox(0))
    generator.bit_generator.state = {
        "bit_generator": "Philox",
        "state": {
            "counter": np.array([position, purpose, 0, 0], np.uint64),
            "key": np.array([seed, 0], np.uint64),
        },
        "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0,
    }  # fmt: skip
    return float(generator.random())
