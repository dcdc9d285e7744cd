"""The target model in torch, for making a head's training data on a GPU.

The served runtimes are CPU code; on a machine with a GPU, answering thousands of prompts is far
faster as one padded batch in torch. This computes the same llama block as the numpy oracle
(`llama.Model`, from the same prepared weights: norms folded into the products, rotate-half RoPE),
in float32 with TF32 off, so its features differ from the served runtime's only by rounding and
the served runtime's int8 activations: noise the head is trained to tolerate anyway.

It serves the llama block only (llama, qwen2 with its biases); a family with QK-norm, post-norms,
GeGLU or a sliding window is refused rather than approximated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.model.config import ModelConfig
from pipeline.training.distill import TEMPERATURE, Answerer, Triple, sampled


def check_supported(cfg: ModelConfig) -> None:
    plain = (
        cfg.activation == "silu" and not cfg.qk_norm and not cfg.post_norms and not cfg.local_layers
        and cfg.embed_scale == 1.0 and not cfg.rope_freq_factors and cfg.rope_scale == 1.0
    )  # fmt: skip
    if not plain:
        raise ValueError(f"the torch target computes the llama block only, not {cfg.architecture}'s")


class TorchTarget:
    """The target's forward over a left-padded batch with a KV cache, returning each fed row's
    features: the residual stream after each layer in `taps` (RMS-normalised, no weight) and the
    final norm's output, side by side."""

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, np.ndarray], device: str, taps: Sequence[int] = ()
    ):
        check_supported(cfg)
        self.cfg, self.device, self.taps = cfg, device, tuple(taps)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

        def put(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(weights[name], np.float32)).to(
                device
            )  # a copy: the cache is read-only

        self.embed, self.out_norm = put("embed"), put("out_norm")
        self.head = put("head") if "head" in weights else self.embed
        self.wqkv, self.wo, self.wgu, self.wdown = put("wqkv"), put("wo"), put("wgu"), put("wdown")
        self.bqkv = put("bqkv") if "bqkv" in weights else None
        half = cfg.head_dim // 2
        inv = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(cfg.context_length, dtype=torch.float64), inv)
        self.cos, self.sin = angles.cos().float().to(device), angles.sin().float().to(device)

    @property
    def feature_width(self) -> int:
        return self.cfg.d_model * (len(self.taps) + 1)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, heads, hd) rotated by positions (B, T)."""
        half = x.shape[-1] // 2
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
        start: int, valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """ids, positions (B, T) written at cache slots start..start+T; `valid` (B, slots) marks the
        slots that hold real tokens. Returns (logits of the last row (B, vocab), features (B, T, F))."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        b, t = ids.shape
        q_dim, kv_dim, hd = cfg.q_dim, cfg.kv_dim, cfg.head_dim
        end = start + t
        keys, values = cache
        slots = torch.arange(end, device=self.device)
        rows = (start + torch.arange(t, device=self.device))[:, None]
        # A padding row sees only itself: a row with every key masked would give NaN, and NaN
        # times a zero weight is still NaN in the rows that skip it.
        mask = ((slots[None, :] <= rows)[None] & (valid[:, None, :end] | (slots[None, :] == rows)[None]))[
            :, None
        ]
        x = self.embed[ids]
        taps = []
        for layer in range(cfg.n_layers):
            qkv = F.rms_norm(x, (cfg.d_model,), eps=eps) @ self.wqkv[layer]
            if self.bqkv is not None:
                qkv = qkv + self.bqkv[layer]
            q = self.rope(qkv[..., :q_dim].view(b, t, cfg.n_heads, hd), positions)
            k = self.rope(qkv[..., q_dim : q_dim + kv_dim].view(b, t, cfg.n_kv_heads, hd), positions)
            keys[layer, :, :, start:end] = k.transpose(1, 2)
            values[layer, :, :, start:end] = (
                qkv[..., q_dim + kv_dim :].view(b, t, cfg.n_kv_heads, hd).transpose(1, 2)
            )
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys[layer, :, :, :end], values[layer, :, :, :end], attn_mask=mask,
                scale=cfg.query_scale, enable_gqa=True,
            )  # fmt: skip
            x = x + attn.transpose(1, 2).reshape(b, t, q_dim) @ self.wo[layer]
            gate_up = F.rms_norm(x, (cfg.d_model,), eps=eps) @ self.wgu[layer]
            x = x + (F.silu(gate_up[..., : cfg.d_ff]) * gate_up[..., cfg.d_ff :]) @ self.wdown[layer]
            if layer in self.taps:
                taps.append(F.rms_norm(x, (cfg.d_model,), eps=eps))
        final = F.rms_norm(x, (cfg.d_model,), eps=eps) * self.out_norm
        logits = final[:, -1] @ self.head.T
        return logits, torch.cat([*taps, final], dim=-1)

    @torch.no_grad()
    def answer(
        self,
        prompts: Sequence[list[int]],
        drawn: Sequence[bool],
        *,
        max_new: int,
        eos: int | None,
        seed: int,
    ) -> list[Triple]:
        """Each prompt answered (greedily, or at TEMPERATURE where `drawn`), all together:
        (tokens, prompt length, float16 features for every token but the newest), as `distill`."""
        cfg, dev = self.cfg, self.device
        b, longest = len(prompts), max(len(p) for p in prompts)
        slots = longest + max_new
        pad = torch.tensor([longest - len(p) for p in prompts], device=dev)
        ids = torch.zeros((b, longest), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p) :] = torch.tensor(p, device=dev)
        positions = (torch.arange(longest, device=dev)[None] - pad[:, None]).clamp(min=0)
        valid = torch.arange(slots, device=dev)[None] >= pad[:, None]
        shape = (cfg.n_layers, b, cfg.n_kv_heads, slots, cfg.head_dim)
        cache = torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)
        gen = torch.Generator(device=dev).manual_seed(seed)
        hot = torch.tensor(list(drawn), device=dev)
        logits, feats = self.forward(ids, positions, cache, 0, valid)
        steps, chunks = [], [feats]
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        here = positions[:, -1:]  # each row's newest position
        for step in range(max_new):
            probs = torch.softmax(logits / TEMPERATURE, dim=-1)
            token = torch.where(hot, torch.multinomial(probs, 1, generator=gen)[:, 0], logits.argmax(-1))
            steps.append(token)
            done |= token == eos if eos is not None else done
            if bool(done.all()) or step == max_new - 1:
                break
            here = here + 1
            logits, feats = self.forward(token[:, None], here, cache, longest + step, valid)
            chunks.append(feats)
        answers = torch.stack(steps, dim=1).cpu().numpy()
        features = torch.cat(chunks, dim=1).half().cpu().numpy()
        out = []
        for i, p in enumerate(prompts):
            answer = answers[i].tolist()
            if eos is not None and eos in answer:
                answer = answer[: answer.index(eos) + 1]
            tokens = np.asarray([*p, *answer], np.int32)
            start = longest - len(p)
            out.append((tokens, len(p), features[i, start : start + len(tokens) - 1]))
        return out


def answer_all(
    target: TorchTarget, prompts: Sequence[list[int]], rule: Callable[[int], bool], *, max_new: int,
    batch: int, eos: int | None, seed: int, report: Callable[[str], None] = print,
) -> list[Triple]:  # fmt: skip
    """Every prompt answered (at TEMPERATURE where `rule(index)`), in batches of similar length so
    little is padding, returned in the prompts' order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list = [None] * len(prompts)
    start, made = time.perf_counter(), 0
    for b in range(0, len(order), batch):
        chunk = order[b : b + batch]
        answers = target.answer([prompts[i] for i in chunk], [rule(i) for i in chunk], max_new=max_new,
                                eos=eos, seed=seed * 1_000_003 + b)  # fmt: skip
        for i, a in zip(chunk, answers, strict=True):
            out[i] = a
            made += len(a[0]) - a[1]
        report(
            f"data: {b + len(chunk)}/{len(prompts)} answers, {made / (time.perf_counter() - start):.0f} tok/s"
        )
    return out


def torch_answerer(
    target: TorchTarget, *, max_new: int, batch: int, seed: int, samples: int, eos: int | None,
    report: Callable[[str], None] = print,
) -> Answerer:  # fmt: skip
    """`distill`'s answerer on the torch target: a shard's answers in batches of `batch`, with the
    data set's own rule for which answers are sampled."""

    def answer(prompt_tokens: list[list[int]], first_index: int) -> list[Triple]:
        return answer_all(
            target, prompt_tokens, lambda i: sampled(first_index + i, samples), max_new=max_new, batch=batch,
            eos=eos, seed=seed * 1_000_003 + first_index, report=report,
        )  # fmt: skip

    return answer
