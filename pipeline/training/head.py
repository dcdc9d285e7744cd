"""The draft head in torch, for training: the same computation `model.draft_head` runs natively.

fc over [embedding of the next token; the target's feature], one pre-norm llama decoder layer
(rotate-half RoPE, grouped-query attention, SwiGLU), and a final RMS norm giving the predicted
feature. Logits are the prediction times the target's frozen output rows for the draft vocabulary.

A head may read more of the target than its final norm's output (EAGLE-3): the residual stream
after some earlier layers too, side by side. `fuse` projects such a wide true feature to the model
width; a drafted row reads the previous row's prediction directly, as the plain head does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TorchHead(nn.Module):
    def __init__(self, cfg: ModelConfig, d_ff: int, feature_width: int | None = None) -> None:
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.cfg, self.d_ff = cfg, d_ff
        self.feature_width = feature_width or d
        if self.feature_width != d:  # starts as the plain head: the final-norm slice passes through
            taps = self.feature_width - d
            self.fuse = nn.Parameter(torch.cat([0.02 * torch.randn(d, taps) / 4, torch.eye(d)], dim=1))
        self.fc = nn.Parameter(torch.cat([0.02 * torch.randn(d, d), torch.eye(d)], dim=1))
        self.wq = nn.Parameter(0.02 * torch.randn(cfg.n_heads * hd, d))
        self.wk = nn.Parameter(0.02 * torch.randn(cfg.n_kv_heads * hd, d))
        self.wv = nn.Parameter(0.02 * torch.randn(cfg.n_kv_heads * hd, d))
        self.wo = nn.Parameter(0.02 * torch.randn(d, cfg.n_heads * hd) / 4)
        self.w_gate = nn.Parameter(0.02 * torch.randn(d_ff, d))
        self.w_up = nn.Parameter(0.02 * torch.randn(d_ff, d))
        self.w_down = nn.Parameter(0.02 * torch.randn(d, d_ff) / 4)
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.out_norm = nn.Parameter(torch.ones(d))
        half = hd // 2
        inv = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(cfg.context_length, dtype=torch.float64), inv)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, heads, T, hd) rotated by position 0..T-1 (rotate-half, as `llama.Rope`)."""
        t, half = x.shape[2], x.shape[-1] // 2
        cos, sin = self.cos[:t], self.sin[:t]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """The target's true features (..., feature_width) at the model width, as a row reads them."""
        return features if self.feature_width == self.cfg.d_model else features @ self.fuse.T

    def forward(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(B, T, d) next-token embeddings and fused features -> (B, T, d) predicted next features."""
        return self.run(embedded, features)[0]

    def run(
        self, embedded: torch.Tensor, features: torch.Tensor, context: tuple | None = None
    ) -> tuple[torch.Tensor, tuple]:
        """`forward`, and the rows' rotated keys and values. With `context` (another pass's keys and
        values), row p attends to that pass's rows before p and to itself: a row drafted from a
        predicted feature, over a history of true ones, as the head drafts its second token."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        b, t, _ = embedded.shape
        x = torch.cat([embedded, features], dim=-1) @ self.fc.T
        h = rms_norm(x, self.attn_norm, eps)
        q = self.rope((h @ self.wq.T).view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2))
        k = self.rope((h @ self.wk.T).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2))
        v = (h @ self.wv.T).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        group = cfg.n_heads // cfg.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if context is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attn = self.attend_after(q, k, v, *context)
        x = x + attn.transpose(1, 2).reshape(b, t, -1) @ self.wo.T
        h = rms_norm(x, self.ffn_norm, eps)
        x = x + (F.silu(h @ self.w_gate.T) * (h @ self.w_up.T)) @ self.w_down.T
        return rms_norm(x, self.out_norm, eps), (k, v)

    def attend_after(self, q, k, v, k_ctx, v_ctx) -> torch.Tensor:
        """Row p's attention over the context rows before p and its own key (B, H, T, hd)."""
        t = q.shape[2]
        scale = self.cfg.head_dim**-0.5
        scores = (q @ k_ctx.transpose(-1, -2)) * scale
        before = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-1)
        scores = scores.masked_fill(~before, float("-inf"))
        own = (q * k).sum(-1, keepdim=True) * scale
        weights = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1)
        return weights[..., :t] @ v_ctx + weights[..., t:] * v

    def arrays(self) -> dict[str, np.ndarray]:
        """The weights as `draft_head.save_head` stores them."""
        return {name: p.detach().float().cpu().numpy() for name, p in self.named_parameters()}
