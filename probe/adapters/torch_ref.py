"""`torch[:DEVICE[:DTYPE]]`: an independent torch implementation of the Qwen3.5 head from raw tensor ops.

No transformers class is used: this is a second transcription of the head (from the C ABI header's description),
so agreeing with the oracle is evidence, not a tautology. It runs the T teacher-forced steps as one causal pass.
In bfloat16 the weights and activations are bf16 while norms, softmax and RoPE angles run in float32, as engines
usually do; it then misses the float32 tolerance and meets the bfloat16 profile (probe/tolerance.py).

It is not a driven candidate of the draft loop (issue 24): it transcribes the bridge step (depth 1) only. Driving
its chains through the oracle's one loop implementation (oracle/draft_loop.py) would need that loop's `Head`
(steps through a transformers DynamicCache under an additive mask), and the probe never imports transformers
(tests/test_dependencies.py); giving it a loop of its own would be a second implementation of the loop
semantics, which the issue rules out. Against a reference with chains it therefore captures no chain, and the
verdict says the loop was not checked (inconclusive), never a pass about depths it did not compute.
"""

from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint
from oracle.stages import STAGE_NAMES
from oracle.trace import TraceInputs
from probe.errors import AdapterError

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")


class TorchAdapter:
    supports_chains = False  # depth 1 only: see the module docstring

    def __init__(self, checkpoint: Path, device: str = "cpu", dtype: str = "float32"):
        import torch

        if device not in DEVICES or dtype not in DTYPES:
            raise AdapterError(f"torch adapter: device must be one of {DEVICES} and dtype one of {DTYPES}, "
                               f"got torch:{device}:{dtype}.")
        if device == "cuda" and not torch.cuda.is_available():
            raise AdapterError("torch:cuda asked for, but torch sees no CUDA device; use torch:cpu.")
        ckpt = Checkpoint(checkpoint)
        if ckpt.family.name != "qwen3_5":
            raise AdapterError(f"--impl torch: the built-in transcription implements the dense Qwen3.5 head only; "
                               f"{checkpoint} is a {ckpt.family.name} head. Use python:MODULE:FACTORY, or diff a "
                               f"trace your engine wrote.")
        self.cfg = ckpt.config
        self.batched_config = self.cfg  # it attends over all T steps at once: `run` checks memory for that too
        self.name = f"torch:{device}:{dtype}"
        self.deterministic = device == "cpu"  # GPU kernels may pick other algorithms run to run
        self._device, self._dtype = torch.device(device), getattr(torch, dtype)
        head = ckpt.read_head()
        self.weights_digest = head.digest
        self._w = {name.removeprefix("mtp.").removeprefix("layers.0."): torch.from_numpy(arr).to(
            self._device, self._dtype) for name, arr in head.tensors.items()}

    def run(self, inputs: TraceInputs) -> dict[str, np.ndarray]:
        import torch

        with torch.inference_mode():
            embed, hidden = (torch.from_numpy(a).to(self._device, self._dtype) for a in (inputs.embed, inputs.hidden))
            stages = self._forward(embed, hidden, torch.from_numpy(inputs.positions).to(self._device))
        return {name: stages[name].float().cpu().numpy() for name in STAGE_NAMES}

    def _forward(self, embed, hidden, positions) -> dict:
        import torch

        w, s = self._w, {}
        s["e"] = _rmsnorm1p(embed, w["pre_fc_norm_embedding.weight"], self.cfg.rms_norm_eps)
        s["h"] = _rmsnorm1p(hidden, w["pre_fc_norm_hidden.weight"], self.cfg.rms_norm_eps)
        s["fc_in"] = torch.cat([s["e"], s["h"]], dim=-1)  # (T, D) x 2 -> (T, 2D), embedding first
        s["fc"] = s["fc_in"] @ w["fc.weight"].T
        s["ah"] = _rmsnorm1p(s["fc"], w["input_layernorm.weight"], self.cfg.rms_norm_eps)
        s["attn"] = self._attention(s["ah"], positions)
        s["res1"] = s["fc"] + s["attn"]
        s["mh"] = _rmsnorm1p(s["res1"], w["post_attention_layernorm.weight"], self.cfg.rms_norm_eps)
        gate, up = s["mh"] @ w["mlp.gate_proj.weight"].T, s["mh"] @ w["mlp.up_proj.weight"].T
        s["mlp"] = (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T
        s["res2"] = s["res1"] + s["mlp"]
        s["out"] = _rmsnorm1p(s["res2"], w["norm.weight"], self.cfg.rms_norm_eps)
        return s

    def _attention(self, x, positions):
        import torch

        cfg, w = self.cfg, self._w
        t, heads, kv, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_gate = (x @ w["self_attn.q_proj.weight"].T).view(t, heads, 2 * hd)  # rows per head: [q_h | gate_h]
        q, gate = q_gate[..., :hd], q_gate[..., hd:].reshape(t, heads * hd)
        q = _rmsnorm1p(q, w["self_attn.q_norm.weight"], cfg.rms_norm_eps)  # per head over hd
        k = _rmsnorm1p((x @ w["self_attn.k_proj.weight"].T).view(t, kv, hd), w["self_attn.k_norm.weight"],
                       cfg.rms_norm_eps)
        v = (x @ w["self_attn.v_proj.weight"].T).view(t, kv, hd)
        cos, sin = _rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = heads // kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (T, KV, hd) -> (T, H, hd)
        scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * hd**-0.5  # (H, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1).to(x.dtype)
        out = torch.einsum("hts,shd->thd", probs, v).reshape(t, heads * hd)  # (H, T, hd) -> (T, H*hd)
        return (out * torch.sigmoid(gate)) @ w["self_attn.o_proj.weight"].T


def _rmsnorm1p(x, weight, eps: float):
    """x / rms(x) * (1 + w), computed in float32 and cast back."""
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def _rope_tables(positions, rotary_dim: int, theta: float):
    """cos/sin (T, 1, rotary_dim), NeoX layout: the rotary_dim/2 frequencies repeated twice. Angles in float32."""
    import torch

    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
                               / rotary_dim)
    angles = positions.float()[:, None] * inv_freq[None]  # (T,) x (rot/2,) -> (T, rot/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (T, rot/2) -> (T, 1, rot)
    return angles.cos(), angles.sin()


def _rotate(x, cos, sin):
    """NeoX rotation of the leading rotary dims of each head; the rest pass through."""
    import torch

    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot].float(), x[..., rot:]
    half = rot // 2
    rotated = x_rot * cos + torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1) * sin
    return torch.cat([rotated.to(x.dtype), x_pass], dim=-1)
