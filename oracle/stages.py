"""Stages: what an MTP head records per step, with the metadata that lets a trace explain itself.

A stage has a name, a shape in symbols (T×D, T×2D, T×E, T×k, T×hc·D), a kind and a one-line doc:

    kind "rows"       float32 [T, width], judged per row by the tolerance rule (probe/tolerance.py)
    kind "index_set"  int64 [T, k], each row compared as a set (e.g. the experts a router selected)

Each family (oracle/families/) declares its ordered `StageList`, built from the definitions below so that a name
means the same thing in every family; "first divergent stage" means first in that order. A trace stores its list
(root attribute `stages`, and `doc`/`kind`/`shape` on each dataset), so the probe reads the order and the meaning
from the reference itself and needs no family code.

`STAGES` is the spine of the Qwen3.5-style stem (the list a trace written before families has). It imports nothing
heavy: the probe reads it.
"""

from dataclasses import dataclass, replace

ROWS, INDEX_SET = "rows", "index_set"
LEGACY_FAMILY = "qwen3_5"  # a trace without a `family` attribute was written before the seam: Qwen3.5 dense
KINDS = (ROWS, INDEX_SET)
_DTYPE = {ROWS: "float32", INDEX_SET: "int64"}


@dataclass(frozen=True)
class Dims:
    """The sizes a stage's width is written in: D (hidden), E (routed experts), k (experts per token), hc (streams)."""

    hidden_size: int
    num_experts: int = 0
    top_k: int = 0
    hc_mult: int = 1

    def to_dict(self) -> dict:
        return {"D": self.hidden_size, "E": self.num_experts, "k": self.top_k, "hc": self.hc_mult}

    @staticmethod
    def from_dict(d: dict) -> "Dims":
        return Dims(int(d["D"]), int(d.get("E", 0)), int(d.get("k", 0)), int(d.get("hc", 1)))


_WIDTH = {
    "T×D": lambda d: d.hidden_size,
    "T×2D": lambda d: 2 * d.hidden_size,
    "T×E": lambda d: d.num_experts,
    "T×k": lambda d: d.top_k,
    "T×hc·D": lambda d: d.hc_mult * d.hidden_size,
    "T×1": lambda d: 1,
}
SHAPES = tuple(_WIDTH)


@dataclass(frozen=True)
class Stage:
    name: str
    shape: str  # one of SHAPES
    doc: str
    kind: str = ROWS

    def __post_init__(self) -> None:
        if self.shape not in _WIDTH or self.kind not in KINDS:
            raise ValueError(f"stage {self.name}: shape {self.shape!r} / kind {self.kind!r} unknown")

    @property
    def dtype(self) -> str:
        return _DTYPE[self.kind]

    def width(self, dims: "Dims | int") -> int:
        """Row width in `dims` (a plain int is the hidden size D)."""
        return _WIDTH[self.shape](Dims(dims) if isinstance(dims, int) else dims)

    def with_doc(self, doc: str) -> "Stage":
        return replace(self, doc=doc)


class StageList(tuple):
    """An ordered tuple of Stages with lookup by name."""

    def __new__(cls, stages):
        stages = tuple(stages)
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate stage names in {names}")
        return super().__new__(cls, stages)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self)

    def __getitem__(self, key):
        if isinstance(key, str):
            for s in self:
                if s.name == key:
                    return s
            raise KeyError(f"no stage {key!r}; stages are {', '.join(self.names)}")
        return super().__getitem__(key)

    def index(self, name) -> int:  # by name (tuple.index would compare Stage objects)
        return self.names.index(name.name if isinstance(name, Stage) else name)

    def after(self, name: str) -> tuple[str, ...]:
        """`name` and every stage after it."""
        return self.names[self.index(name):]


# --- The spine: the Qwen3.5-style stem and one pre-norm decoder layer. ---
E = Stage("e", "T×D", "normed embedding of the step token: the stem's embedding norm (Qwen: (1+w) RMSNorm; "
                      "DeepSeek/GLM: enorm)")
H = Stage("h", "T×D", "normed main-model hidden H_i (post-final-norm, normed again): the stem's hidden norm "
                      "(Qwen: pre_fc_norm_hidden; DeepSeek/GLM: hnorm)")
FC_IN = Stage("fc_in", "T×2D", "concat(e, h), embedding first")
FC = Stage("fc", "T×D", "the stem's projection of fc_in, [2D] -> [D] (Qwen: fc; DeepSeek/GLM: eh_proj)")
AH = Stage("ah", "T×D", "attention input: input_layernorm(fc)")
ATTN = Stage("attn", "T×D", "attention output after o_proj, before the residual add")
RES1 = Stage("res1", "T×D", "first residual: fc + attn")
MH = Stage("mh", "T×D", "MLP input: post_attention_layernorm(res1)")
MLP = Stage("mlp", "T×D", "MLP output (MoE: routed + shared)")
RES2 = Stage("res2", "T×D", "second residual: res1 + mlp")
OUT = Stage("out", "T×D", "head output: the final norm of res2, fed to lm_head and recycled for draft k+1")

# --- MoE stages, between mh and mlp. ---
ROUTER_LOGITS = Stage("router_logits", "T×E", "the router's linear output (gate(mh)), before softmax/sigmoid")
TOPK_IDS = Stage("topk_ids", "T×k", "the experts selected for the token, compared as a set", kind=INDEX_SET)
TOPK_WEIGHTS = Stage("topk_weights", "T×k", "the final weights of the selected experts, in topk_ids' order")
SHARED = Stage("shared", "T×D", "the shared expert's output, gated where the family gates it")
ROUTED = Stage("routed", "T×D", "the weighted sum of the selected experts' outputs")
MOE = (ROUTER_LOGITS, TOPK_IDS, TOPK_WEIGHTS, SHARED, ROUTED)

SPINE = StageList((E, H, FC_IN, FC, AH, ATTN, RES1, MH, MLP, RES2, OUT))


def with_moe(spine: StageList) -> StageList:
    """`spine` with the MoE stages between mh and mlp."""
    at = spine.index("mlp")
    return StageList(spine[:at] + MOE + spine[at:])


# --- Hyper-connection (mHC) heads (DeepSeek-V4): hc_mult residual streams of width D around one block. ---
E_PROJ = Stage("e_proj", "T×D", "e_proj(e): the embedding's projection, added to every stream")
H_PROJ = Stage("h_proj", "T×hc·D", "h_proj(h), per stream")
X_IN = Stage("x_in", "T×hc·D", "the block's input streams: h_proj(h) + e_proj(e), the e term broadcast to every stream")
AFTER_ATTN = Stage("after_attn", "T×hc·D", "the streams after the attention hyper-connection: "
                                           "post * attn + comb^T @ x_in")
BLOCK_OUT = Stage("block_out", "T×hc·D", "the block's output streams (after the MLP hyper-connection): recycled "
                                         "as the hidden for draft k+1")
HEAD_COLLAPSED = Stage("head_collapsed", "T×D", "the head's hyper-connection collapse of block_out (hc_head), before "
                                                "the final norm")
HC_STAGES = (X_IN, AFTER_ATTN, BLOCK_OUT, HEAD_COLLAPSED, E_PROJ, H_PROJ)

# --- The draft (issue 24): the head's argmax token of its draft projection applied to `out`, last in a list. ---
DRAFT = Stage("draft", "T×1", "the draft token: argmax of the family's draft projection (lm_head) applied to out, "
                              "by the screened exact argmax", kind=INDEX_SET)

# Every stage name any family uses (for validating names before a reference says which family it is).
KNOWN_STAGE_NAMES: tuple[str, ...] = with_moe(SPINE).names + tuple(s.name for s in HC_STAGES) + (DRAFT.name,)

# The default list: a trace that records no stage metadata (written before families) has these stages.
STAGES: StageList = SPINE
STAGE_NAMES: tuple[str, ...] = STAGES.names
STAGE_BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
# The ten intermediate stages the C ABI v1 trace struct exposes; `out` is the step's own output.
TRACE_STAGE_NAMES: tuple[str, ...] = STAGE_NAMES[:-1]


def stage_index(name: str) -> int:
    """Position of `name` in the default STAGES order (0-based)."""
    return STAGE_NAMES.index(name)
