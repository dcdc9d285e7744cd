"""speclanes' native runtime and llama.cpp taking turns on one file: step times whose ratio holds on a
loaded machine.

`speclanes bench model` times each runtime for a while, one after the other; when other work on
the machine comes and goes, the two spans see different loads. Here each runtime lives in its own
process (their thread pools never spin against each other) and they alternate in short turns of
a few steps, for several rounds, so both see the same load; the medians' ratio is the figure.
Each prints the same cache length and rows as `bench model` (T = 1..16 at a 512-token context).

    LLAMA_CPP_LIB_PATH=.venv/peers/llama.cpp/build/bin \\
        .venv/bin/python ops/bench/interleaved_steps.py [--model PATH] [--rounds 6] [--rows 1,2,4,8,16]

(On an AMX machine llama-cpp-python's own libraries crash: point LLAMA_CPP_LIB_PATH at the build
of ops/bench/install_peers.sh.) Without --model: Gemma 3 270M Q4_K_M.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CONTEXT = 512


def speclanes_turns(conn: Connection, path: str) -> None:
    from pipeline.model import load_model

    model = load_model(path, "native")
    rng = np.random.default_rng(0)
    cache = model.new_cache(capacity=CONTEXT + 32)
    model.forward(cache, rng.integers(17, 40000, size=CONTEXT).tolist(), all_logits=False)

    def step(tokens: list[int]) -> None:
        model.forward(cache, tokens)
        cache.truncate(CONTEXT)

    serve(conn, step, model.describe(), rng)


def llama_cpp_turns(conn: Connection, path: str) -> None:
    import llama_cpp

    model = llama_cpp.Llama(model_path=path, n_ctx=CONTEXT + 64, n_threads=2, verbose=False, logits_all=True)
    rng = np.random.default_rng(0)
    model.eval(rng.integers(17, 40000, size=CONTEXT).tolist())

    def step(tokens: list[int]) -> None:
        model.n_tokens = CONTEXT  # roll back to the filled cache, as the speclanes side does
        model.eval(tokens)

    serve(conn, step, f"llama-cpp-python {llama_cpp.__version__}", rng)


def serve(conn: Connection, step, description: str, rng: np.random.Generator) -> None:
    """Answer each turn (rows, steps) with the steps' seconds, the first (a warm-up) left out."""
    conn.send(description)
    while (turn := conn.recv()) is not None:
        rows, steps = turn
        tokens = rng.integers(17, 40000, size=rows).tolist()
        seconds = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            step(tokens)
            seconds.append(time.perf_counter() - start)
        conn.send(seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file (default: Gemma 3 270M Q4_K_M)")
    parser.add_argument("--rounds", type=int, default=6, help="turns per runtime and row count")
    parser.add_argument("--steps", type=int, default=5, help="steps per turn")
    parser.add_argument("--rows", default="1,2,4,8,16", help="rows per step, comma-separated")
    args = parser.parse_args()
    if args.model is None:
        from pipeline.model.default import gemma3_path

        args.model = str(gemma3_path())
    spawn = mp.get_context("spawn")
    pipes = {}
    for name, target in (("speclanes", speclanes_turns), ("llama.cpp", llama_cpp_turns)):
        mine, theirs = spawn.Pipe()
        spawn.Process(target=target, args=(theirs, args.model), daemon=True).start()
        print(f"{name}: {mine.recv()}", flush=True)
        pipes[name] = mine
    for rows in (int(r) for r in args.rows.split(",")):
        got: dict[str, list[float]] = {name: [] for name in pipes}
        for _ in range(args.rounds):
            for name, conn in pipes.items():
                time.sleep(0.2)  # the other process's threads stop spinning and sleep
                conn.send((rows, args.steps))
                got[name] += conn.recv()
        ours, theirs = (statistics.median(got[name]) * 1e3 for name in pipes)
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"T={rows:>2}: speclanes {ours:7.2f} ms  llama.cpp {theirs:7.2f} ms  "
              f"llama.cpp / speclanes {theirs / ours:.2f}  (load average {load})", flush=True)  # fmt: skip
    for conn in pipes.values():
        conn.send(None)


if __name__ == "__main__":
    main()
