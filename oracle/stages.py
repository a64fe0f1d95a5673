"""The ordered stage registry: the one list of stage names in the project.

Every other module derives from `STAGES`: the oracle records these names, they are the HDF5 dataset names of an
`mtp-trace/1` file, the probe compares in this order, and "first divergent stage" means first in this order.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    width_in_hidden: int  # the stage's row width is width_in_hidden * hidden_size
    doc: str

    def width(self, hidden_size: int) -> int:
        return self.width_in_hidden * hidden_size


STAGES: tuple[Stage, ...] = (
    Stage("e", 1, "rmsnorm1p(embed[t], pre_fc_norm_embedding)"),
    Stage("h", 1, "rmsnorm1p(H, pre_fc_norm_hidden); H is the main model's post-final-norm hidden"),
    Stage("fc_in", 2, "concat(e, h), embedding first"),
    Stage("fc", 1, "fc(fc_in): [2D] -> [D]"),
    Stage("ah", 1, "rmsnorm1p(fc, input_layernorm): the attention input"),
    Stage("attn", 1, "gated attention output after o_proj, before the residual add"),
    Stage("res1", 1, "fc + attn"),
    Stage("mh", 1, "rmsnorm1p(res1, post_attention_layernorm): the MLP input"),
    Stage("mlp", 1, "down(silu(gate(mh)) * up(mh))"),
    Stage("res2", 1, "res1 + mlp"),
    Stage("out", 1, "rmsnorm1p(res2, mtp.norm): the head output fed to lm_head"),
)

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
STAGE_BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
# The ten intermediate stages an engine's trace struct exposes; `out` is the step's own output ("expect").
TRACE_STAGE_NAMES: tuple[str, ...] = STAGE_NAMES[:-1]


def stage_index(name: str) -> int:
    """Position of `name` in STAGES order (0-based)."""
    return STAGE_NAMES.index(name)
