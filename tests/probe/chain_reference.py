"""Chain references for the probe's tests, until `mtp-oracle export --chain K` writes them (issue 24).

A real depth-1 export of the tiny Qwen3.5 fixture (the oracle's own CLI), plus depths 2..K computed here with the
oracle's head (its official modules, oracle/families/qwen3_5.py) one step at a time through its own KV cache, as
the draft loop's semantics say (shared/DESIGN.md "The draft loop"): chain from bridge i, depth j, token x_{i+j}
(teacher-forced), recycled hidden = depth j-1's `out` (depth 1's for j = 2), position p_i + j - 1; the cache holds
bridge entries 0..i and this chain's own entries, dropped after the chain. The draft is the exact argmax of
lm_head(out) (float64 logits of a 512-token vocabulary), with its top-1 minus top-2 margin and the projection's
largest row norm. Evidence per depth: attn recomputed from the same ah with uniform weights over the visible keys,
and h_if_prenorm / h_if_main (the h recycling res2 or the main hidden H_i would have given). Written with h5py by
tests/probe/tracekit.py's chain writer, exactly per the schema, as an engine team would.
"""

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.helpers import TINY

TOKENS = (17, 3, 99, 250, 41, 7, 300, 12, 5, 88)


@dataclass
class Chain:
    """What a reference records: depth 1 (stages, evidence) and each depth j >= 2 (inputs, stages, evidence)."""

    depth1: dict[str, np.ndarray]  # the draft stage and its evidence, to add to the exported depth 1
    depths: dict[int, dict[str, dict[str, np.ndarray]]]  # j -> {"inputs"|"stages"|"evidence": {name: rows}}
    row_norm_max: float


def export_depth1(path: Path, tokens=TOKENS) -> Path:
    from oracle.cli import main

    main(["export", str(TINY), "--out", str(path), "--tokens", ",".join(map(str, tokens)), "--hidden-seed", "0",
          "--mode", "stepwise", "-q"], standalone_mode=False)
    return path


def compute_chain(inputs, out: np.ndarray, depths: int, checkpoint: Path = TINY, recycle: str = "out",
                  freeze_position: bool = False) -> Chain:
    """Depths 2..`depths` of every bridge position that has them, for the trace `inputs` (TraceInputs) whose depth-1
    `out` rows are given (the draft of depth 1 is taken from them). `recycle` (a stage name) and `freeze_position`
    (every depth at the bridge's position) build the engine bugs the probe must catch, with the same head."""
    import torch
    from transformers import DynamicCache

    from oracle.attention_evidence import uniform_weights
    from oracle.checkpoint import Checkpoint
    from oracle.families.registry import head_module

    ckpt = Checkpoint(checkpoint)
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False, digest=False)))
    lm_head = _tensor(ckpt, "lm_head.weight").astype(np.float64)  # (V, D)
    embed_table = _tensor(ckpt, "model.language_model.embed_tokens.weight").astype(np.float32)
    total = inputs.num_tokens
    rows = {j: [] for j in range(2, depths + 1)}
    with torch.inference_mode():
        cache = DynamicCache(config=head.text_config)
        for i in range(total):
            bridge = _step(head, rotary, inputs.embed[i], inputs.hidden[i], int(inputs.positions[i]), cache)
            chain_cache = copy.deepcopy(cache)  # chain entries live only for this chain
            recycled, prenorm = bridge[recycle], bridge["res2"]
            for j in range(2, depths + 1):
                if i + j - 1 > total - 1:
                    break
                token = int(inputs.token_ids[i + j - 1])  # teacher-forced: x_{i+j}
                position = int(inputs.positions[i]) + (0 if freeze_position else j - 1)
                embed = embed_table[token]
                with uniform_weights(head.text_config):
                    uniform = _step(head, rotary, embed, recycled, position, copy.deepcopy(chain_cache))["attn"]
                step = _step(head, rotary, embed, recycled, position, chain_cache)
                h_if = {name: head.pre_fc_norm_hidden(torch.from_numpy(x)[None, None])[0, 0].numpy()
                        for name, x in (("prenorm", prenorm), ("main", inputs.hidden[i]))}
                rows[j].append({"bridge": i, "token": token, "position": position, "recycled": recycled,
                                "embed": embed, "stages": step, "uniform": uniform, "h_if": h_if})
                recycled, prenorm = step[recycle], step["res2"]
    norm_max = float(np.sqrt((lm_head ** 2).sum(axis=1)).max())
    return Chain(_draft_of(out, lm_head), {j: _depth_arrays(r, lm_head) for j, r in rows.items()}, norm_max)


def _step(head, rotary, embed: np.ndarray, hidden: np.ndarray, position: int, cache) -> dict[str, np.ndarray]:
    import torch

    e = torch.from_numpy(np.ascontiguousarray(embed, dtype=np.float32))[None, None]  # (D,) -> (1, 1, D)
    h = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))[None, None]
    stages = head.steps(rotary, e, h, torch.tensor([[position]]), None, cache)
    return {name: t[0, 0].numpy().copy() for name, t in stages.items()}  # (1, 1, w) -> (w,)


def _draft_of(out: np.ndarray, lm_head: np.ndarray) -> dict[str, np.ndarray]:
    logits = out.astype(np.float64) @ lm_head.T  # (n, D) @ (D, V) -> (n, V)
    top = np.sort(logits, axis=1)
    return {"draft": logits.argmax(axis=1).astype(np.int64)[:, None],
            "draft_margin": (top[:, -1] - top[:, -2]).astype(np.float32)[:, None]}


def _depth_arrays(rows: list[dict], lm_head: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
    stages = {name: np.stack([r["stages"][name] for r in rows]).astype(np.float32) for name in rows[0]["stages"]}
    draft = _draft_of(stages["out"], lm_head)
    stages["draft"] = draft["draft"]
    inputs = {"bridge": np.array([r["bridge"] for r in rows], np.int64),
              "token_ids": np.array([r["token"] for r in rows], np.int64),
              "positions": np.array([r["position"] for r in rows], np.int64),
              "layer": np.zeros(len(rows), np.int64),
              "recycled": np.stack([r["recycled"] for r in rows]).astype(np.float32),
              "embed": np.stack([r["embed"] for r in rows]).astype(np.float32)}
    evidence = {"attn_uniform": np.stack([r["uniform"] for r in rows]).astype(np.float32),
                "draft_margin": draft["draft_margin"],
                **{f"h_if_{alt}": np.stack([r["h_if"][alt] for r in rows]).astype(np.float32)
                   for alt in rows[0]["h_if"]}}
    return {"inputs": inputs, "stages": stages, "evidence": evidence}


def _tensor(ckpt, name: str) -> np.ndarray:
    from safetensors import safe_open

    for shard in sorted(Path(ckpt.path).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:  # bf16 widens to float32 exactly
            if name in f.keys():
                return f.get_tensor(name).float().numpy()
    raise KeyError(name)


def chain_reference(path: Path, depths: int, tokens=TOKENS) -> Path:
    """A chain reference of depths 2..`depths` at `path`: the oracle's own `export --chain` where this oracle has
    it (oracle/draft_loop.py), else a real depth-1 export plus the chains computed here (`compute_chain`), written
    per the schema by tests/probe/tracekit.py add_chain. test_real_export_agrees_with_the_independent_chain holds
    the two equal."""
    import importlib.util

    if importlib.util.find_spec("oracle.draft_loop") is not None:
        from oracle.cli import main

        main(["export", str(TINY), "--out", str(path), "--tokens", ",".join(map(str, tokens)), "--hidden-seed", "0",
              "--chain", str(depths), "-q"], standalone_mode=False)
        return path
    from tests.probe.tracekit import add_chain, load_trace

    export_depth1(path, tokens)
    inputs, stages = load_trace(path)
    add_chain(path, compute_chain(inputs, stages["out"], depths))
    return path
