"""The peers of `speclanes bench peers`, each in its own worker process.

Why a process per peer: torch, llama.cpp and numpy's OpenBLAS each keep their own thread pools
that spin for a while after work; in separate processes, blocked on a pipe between runs, they cannot
steal the cores of whoever runs next, and a crash in a peer's native code (llama-cpp-python has had
several) costs one row of the table, not the run. Nothing here is imported unless a worker starts,
so the test suite never imports torch or llama_cpp.

Protocol: one JSON object per line. The worker loads its model, then writes `{"ready": ..., "info":
...}`; each request `{"mode", "prompt", "max_tokens"}` gets `{"tokens", "seconds",
"first_token_seconds", "steps"}` back, where `steps` counts the target's forward passes after the
prompt's (so the mean accepted length is comparable with speclanes'). Run it as
`python -m pipeline.bench.peer_workers PEER MODEL_PATH THREADS LOOKUP_TOKENS`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Runner = Callable[[str, list[int], int], dict[str, Any]]


def hf_runner(path: Path, threads: int, lookup: int) -> tuple[Runner, dict[str, Any]]:
    """transformers on torch CPU, float32 weights dequantized from the same GGUF.

    EOS is disabled in the model's own generation config too (a `GenerationConfig` passed to
    `generate` falls back to the model's for unset fields), so exactly `max_tokens` come back; the
    explicit all-ones attention mask keeps transformers from guessing one from the pad id."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    class FirstToken:
        """A streamer that only notes when the first new token arrives (its first put is the prompt)."""

        def __init__(self) -> None:
            self.puts: list[float] = []

        def put(self, _value: Any) -> None:
            self.puts.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(mode: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        config = GenerationConfig(
            max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=2,
            prompt_lookup_num_tokens=lookup if mode == "prompt_lookup" else None,
        )  # fmt: skip
        ids = torch.tensor([prompt], dtype=torch.long)
        streamer, forwards[0] = FirstToken(), 0
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                streamer=streamer,
            )
        seconds = time.perf_counter() - start
        first = streamer.puts[1] - start if len(streamer.puts) > 1 else seconds
        return {
            "tokens": out[0, len(prompt) :].tolist(), "seconds": seconds,
            "first_token_seconds": first, "steps": forwards[0] - 1,
        }  # fmt: skip

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": threads}
    return run, info


def llama_runner(path: Path, threads: int, lookup: int) -> tuple[Runner, dict[str, Any]]:
    """llama-cpp-python on the GGUF as it is (its own quantized kernels).

    `Llama.generate` never stops at EOS by itself, so the caller takes exactly `max_tokens`. The
    prompt-lookup instance is created with `logits_all=True`: a draft model makes `Llama` keep
    logits for every position, but its score buffer is sized by the `logits_all` argument, so
    without it generation fails (ValueError) once the sequence passes `n_batch` positions; the buffer
    holds `n_ctx` rows of 49152 floats, hence the modest `n_ctx`. `reset()` before each run, or
    `generate` would reuse the cached prompt and skip the prefill."""
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = {"model_path": str(path), "n_ctx": 2048, "n_threads": threads, "n_threads_batch": threads,
              "seed": 0, "verbose": False}  # fmt: skip
    models = {
        "plain": Llama(**common),
        "prompt_lookup": Llama(
            **common, logits_all=True, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        ),
    }
    evals = [0]
    for llm in models.values():
        llm.eval = counted(llm.eval, evals)  # type: ignore[method-assign]

    def run(mode: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        llm = models[mode]
        llm.reset()
        evals[0], tokens, first = 0, [], 0.0
        start = time.perf_counter()
        generator: Iterator[int] = llm.generate(prompt, temp=0.0, repeat_penalty=1.0)
        for token in generator:
            if not tokens:
                first = time.perf_counter() - start
            tokens.append(int(token))
            if len(tokens) >= max_tokens:
                break
        seconds = time.perf_counter() - start
        return {"tokens": tokens, "seconds": seconds, "first_token_seconds": first, "steps": evals[0] - 1}

    return run, {"llama_cpp": llama_cpp.__version__, "threads": threads}


def counted(fn: Callable[[Any], None], counter: list[int]) -> Callable[[Any], None]:
    """`fn` that also counts its calls (one call = one forward pass over a block of tokens)."""

    def wrapper(tokens: Any) -> None:
        counter[0] += 1
        fn(tokens)

    return wrapper


RUNNERS = {"hf": hf_runner, "llama_cpp": llama_runner}


def serve(peer: str, path: Path, threads: int, lookup: int) -> None:
    """Answer requests on stdin until it closes. Our protocol keeps the original stdout; fd 1 is
    pointed at stderr so native libraries' prints cannot corrupt it."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    run, info = RUNNERS[peer](path, threads, lookup)
    out.write(json.dumps({"ready": True, "info": info}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = run(request["mode"], request["prompt"], request["max_tokens"])
        except Exception as exc:  # reported as this row's error; the worker stays up
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
