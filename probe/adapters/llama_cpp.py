"""The llama.cpp adapter: `--impl llama.cpp:MODEL.gguf[:LIB]` drives llama.cpp's own MTP graph on the reference's
inputs, in a child process (probe/adapters/llama_cpp_worker.py), and maps the tensors it names with `cb()` onto
the stages.

The map (`LLAMA_CPP_NAMES`, llama.cpp's names without their `-<layer>` suffix -> stage) is the one
shared/reference/mtp_wiring.md §11 gives for upstream's `graph_mtp` (src/models/qwen35.cpp, qwen35moe.cpp): forks
that keep upstream's names need nothing else. Names the graph offered that the map does not place are listed in
`unmapped` (the report shows them), never silently dropped. The draft (`draft`, where the reference has it) is the
argmax of the graph's own logits (`result_output`: lm_head, or the fork's choice of matrix).

The draft loop: against a reference with chains, the worker runs llama.cpp's own loop in its driver's order
(bridge i, its chain, bridge i+1; see probe/adapters/llama_cpp_worker.py). The probe hands it only each depth's
token and position; the hidden is llama.cpp's own, and so is everything each depth computes, captured through the
same cb_eval map as depth 1 and returned as "d{j}". A library without the nextn API runs depth 1 only, and the
verdict says the loop was not checked.

LIB: a user's own build, either libllama.so itself or the folder holding it (with its libggml-base.so), run through
llama-cpp-python's bindings (LLAMA_CPP_LIB_PATH). Without LIB: the libllama that the pinned llama-cpp-python wheel
built and ships.

Weights: the GGUF is the engine's copy of the head. The adapter cannot vouch that it holds the reference's weights
(a quantized GGUF never will bit for bit): `weights_digest` stays None and the report says so; `mtp-probe weights
CKPT MODEL.gguf` audits them tensor by tensor.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from oracle.output import scratch_directory
from oracle.trace import TraceInputs
from probe.adapters.cabi import _tail, _wait_worker
from probe.adapters.cabi_process import start_worker
from probe.errors import AdapterError, CandidateError

# llama.cpp's cb() names (upstream graph_mtp, b9793 and later) -> stage
LLAMA_CPP_NAMES = {
    "mtp_enorm": "e", "mtp_hnorm": "h", "mtp_concat": "fc_in", "mtp_eh_proj": "fc", "mtp_attn_norm": "ah",
    "mtp_attn_out": "attn", "mtp_attn_residual": "res1", "mtp_attn_post_norm": "mh", "mtp_ffn_out": "mlp",
    "mtp_post_ffn": "res2", "h_nextn": "out",
    # MoE (build_moe_ffn's names inside the MTP block, and the shared expert's)
    "ffn_moe_logits": "router_logits", "ffn_moe_topk": "topk_ids", "ffn_moe_weights_norm": "topk_weights",
    "mtp_ffn_moe_out": "routed", "mtp_ffn_shexp_gated": "shared",
}
# named by the graph, not stages of the spine: listed as intermediates, never as unknown
LLAMA_CPP_INTERMEDIATES = {
    "mtp_tok_embd", "mtp_h_input", "mtp_Qcur_full", "mtp_Qcur_normed", "mtp_gate", "mtp_Kcur_normed", "mtp_Vcur",
    "mtp_attn_pregate", "mtp_shared_head_norm", "result_output", "mtp_ffn_shexp", "mtp_shared_expert_gate_sigmoid",
}
_LAYER_SUFFIX = re.compile(r"-(\d+)$")


def base_name(name: str) -> str:
    """`mtp_enorm-4` -> `mtp_enorm` (cb() appends the layer index)."""
    return _LAYER_SUFFIX.sub("", name)


def stages_from_named(named: dict[str, np.ndarray], num_steps: int,
                      names: dict[str, str] = LLAMA_CPP_NAMES) -> tuple[dict[str, np.ndarray], list[str]]:
    """Stage -> [T, width] rows from an engine's named tensors (tokens outermost), and the names not placed. A
    stage two names map to is an error (which one the engine meant is unknown)."""
    stages, sources, unmapped = {}, {}, []
    for name in sorted(named):
        stage = names.get(base_name(name))
        if stage is None:
            if base_name(name) not in LLAMA_CPP_INTERMEDIATES:
                unmapped.append(name)
            continue
        if stage in stages:
            raise CandidateError(f"llama.cpp named both {sources[stage]} and {name}, which map to stage {stage}; "
                                 f"give a name map that picks one (--names).")
        values = np.asarray(named[name])
        if values.size % max(num_steps, 1) or values.size == 0:
            raise CandidateError(f"llama.cpp's {name} holds {values.size} values ({list(values.shape)}), not "
                                 f"{num_steps} rows: was it computed for another batch?")
        rows = values.reshape(num_steps, -1)
        stages[stage] = rows.astype(np.int64) if stage == "topk_ids" else rows.astype(np.float32)
        sources[stage] = name
    return stages, unmapped


class LlamaCppAdapter:
    """Runs llama.cpp's MTP context over the reference's bridge steps (in one batch), or, against a reference with
    chains, llama.cpp's own draft loop (bridge i, its chain, bridge i+1); see the module docstring."""

    deterministic = True
    weights_digest: str | None = None  # never known: see the module docstring
    weights_unverified = "the head ran from the GGUF's own weights, not the checkpoint's (audit them with " \
                         "`mtp-probe weights CKPT MODEL.gguf`)"
    capture_only: tuple[str, ...] | None = None
    supports_chains = True  # run() takes the reference's chain inputs (probe/run.py chain_inputs)
    reference_stages: tuple[str, ...] | None = None  # set by `run`: the draft is returned where the reference has it

    def __init__(self, spec_rest: str, flash_attn: bool = False, threads: int = 1, mutant: str | None = None):
        model, _, lib = spec_rest.partition(":")
        self.model = Path(model)
        if not self.model.is_file() or self.model.suffix != ".gguf":
            raise AdapterError(f"--impl llama.cpp:{spec_rest}: {model} is not a .gguf file. Write one from the "
                               f"checkpoint with `mtp-oracle gguf CHECKPOINT --out head.gguf`.")
        self.lib_dir = _library_folder(Path(lib)) if lib else None
        self.flash_attn, self.threads = flash_attn, threads
        self.mutant = mutant  # a driver loop bug (llama_cpp_worker.LOOP_MUTANTS), for the twins only
        self.name = f"llama.cpp:{self.model.name}" + (f" ({self.lib_dir})" if self.lib_dir else "") + \
            (f" [loop mutant {mutant}]" if mutant else "")
        self.unmapped: list[str] = []
        self.library: str | None = None
        self.chain_skipped: str | None = None

    def run(self, inputs: TraceInputs, chain: dict[int, dict[str, np.ndarray]] | None = None) -> dict:
        """Stage -> [T, width] of depth 1, and with `chain` ({j: token_ids, positions, ...} per depth) "d{j}":
        depth j's stages [n_j, width], from llama.cpp's own loop."""
        with scratch_directory("mtp-llama-") as tmp:
            work = Path(tmp)
            np.save(work / "token_ids.npy", np.asarray(inputs.token_ids, dtype=np.int64))
            np.save(work / "positions.npy", np.asarray(inputs.positions, dtype=np.int64))
            np.save(work / "hidden.npy", np.ascontiguousarray(inputs.hidden, dtype=np.float32))
            if chain:  # the probe says depth, token and position only: the engine recycles its own hidden
                np.savez(work / "chain.npz", **{f"d{j}.{name}": np.asarray(part[name], dtype=np.int64)
                                               for j, part in chain.items() for name in ("token_ids", "positions")})
            (work / "request.json").write_text(json.dumps({"flash_attn": self.flash_attn, "kv_f16": self.flash_attn,
                                                           "threads": self.threads, "mutant": self.mutant}))
            command = [sys.executable, "-m", "probe.adapters.llama_cpp_worker", str(self.model.resolve()), str(work)]
            proc = start_worker(command, work, self._env())
            finished = _wait_worker(proc, work, self.name, inputs.num_tokens)
            return self._results(finished, work, inputs.num_tokens)

    def _env(self) -> dict[str, str] | None:
        return {"LLAMA_CPP_LIB_PATH": str(self.lib_dir)} if self.lib_dir else None

    def _results(self, finished: subprocess.CompletedProcess, work: Path, num_steps: int) -> dict:
        result_file = work / "result.json"
        result = json.loads(result_file.read_text()) if result_file.is_file() else None
        if finished.returncode < 0:
            raise CandidateError(f"{self.name} crashed (signal {-finished.returncode}) inside llama.cpp. Its stderr:\n"
                                 f"{_tail(finished.stderr) or '(none)'}")
        if result is None or result.get("status") != "ok":
            said = result.get("error") if result else f"the worker exited with status {finished.returncode}"
            if result is None and "No module named 'llama_cpp'" in finished.stderr:
                said = ("llama-cpp-python is not installed: `pip install llama-cpp-python==0.3.36` (it builds "
                        "llama.cpp's libllama; see README, 'llama.cpp')")
            raise CandidateError(f"{self.name}: {said}. llama.cpp's log:\n{_log_excerpt(finished.stderr)}")
        self.library = result["library"]
        self.chain_skipped = result.get("chain_skipped")
        stages, self.unmapped = self._depth(work / "captured", result["captured"], num_steps)
        for depth, names in sorted(result.get("chain_captured", {}).items(), key=lambda kv: int(kv[0])):
            rows = names["result_output"][0]  # one logits row per decode of the depth: n_j
            stages[f"d{depth}"], unmapped = self._depth(work / "captured" / f"d{depth}", names, rows)
            self.unmapped += [f"{name} (depth {depth})" for name in unmapped if name not in self.unmapped]
        self.unmapped += [f"{name} ({why})" for name, why in sorted(result.get("skipped", {}).items())
                          if base_name(name.split(" ")[0]) in LLAMA_CPP_NAMES]
        return stages

    def _depth(self, folder: Path, names: dict, num_steps: int) -> tuple[dict[str, np.ndarray], list[str]]:
        """One depth's stages from the worker's files, the draft the argmax of its logits; and the unmapped names."""
        captured = {name: np.load(folder / f"{name}.npy") for name in names}
        logits = captured.pop("result_output")
        stages, unmapped = stages_from_named(captured, num_steps)
        if self.reference_stages is None or "draft" in self.reference_stages:
            stages["draft"] = np.argmax(logits.reshape(num_steps, -1), axis=1).astype(np.int64)[:, None]
        return stages, unmapped


_LOG_ERROR = re.compile(r"\berror\b|failed|inconsistent|required|X = |Y = |GGML_ASSERT|GGML_ABORT")


def _log_excerpt(log: str, limit: int = 12) -> str:
    """The lines of llama.cpp's log that say why it refused (its batch checks log several before `decode: failed`;
    the tail is graph-reservation chatter), else the log's tail."""
    said = [line for line in log.splitlines() if _LOG_ERROR.search(line)]
    return "\n".join(said[:limit]) if said else (_tail(log) or "(none)")


def _library_folder(lib: Path) -> Path:
    """The folder of a user's libllama.so (given as the file or its folder), checked before anything runs."""
    folder = lib if lib.is_dir() else lib.parent
    if not (folder / "libllama.so").is_file():
        raise AdapterError(f"{lib}: no libllama.so there. Pass your build's libllama.so (or its folder, holding "
                           f"libggml-base.so too), e.g. --impl llama.cpp:head.gguf:build/bin/libllama.so.")
    if lib.is_file() and lib.name != "libllama.so":
        raise AdapterError(f"{lib}: llama-cpp-python loads a library named libllama.so; pass that file or its "
                           f"folder.")
    return folder.resolve()


def llama_cpp_available() -> str | None:
    """None when llama-cpp-python imports (with its MTP API), else why not: tests skip with this reason."""
    code = ("import llama_cpp, sys; sys.exit(0 if hasattr(llama_cpp, 'llama_batch_ext_set_embd_token') and "
            "hasattr(llama_cpp, 'llama_model_n_layer_nextn') else 3)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    if proc.returncode == 3:
        return "the installed llama-cpp-python has no MTP API (needs 0.3.36 or later)"
    return f"llama-cpp-python does not import: {_tail(proc.stderr).splitlines()[-1] if proc.stderr else '?'}"

