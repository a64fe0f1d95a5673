"""A tiny Qwen3.5 main model and its MTP head, trained jointly on a synthetic language, in the release layout.

    python scripts/train_tiny.py            # about 1.5 minutes on 2 CPU cores

writes fixtures/qwen3_5_trained/ (config.json + one bf16 model.safetensors) and its held-out text
fixtures/qwen3_5_trained/heldout_tokens.txt, so that `mtp-oracle accept` measures a head that learned something.

The language: sentences `NAME DET [ADJ] NOUN VERB [PREP DET NOUN] NAME .` where every word is a fixed spelling of
2-4 letter tokens, each noun allows 3 of the 8 verbs, and NAME is two random name tokens repeated at the end (a
copy the model can only make through attention). Inside a word the token after next is predictable; at word
boundaries it is a real choice. The head is `oracle.families.qwen3_5.MtpHead` itself, built with real init (not on
meta), so it is trained wired exactly as the oracle reads it. Step i consumes x_{i+1}, the main model's
post-final-norm H_i (detached: the main model learns only next-token prediction) and position i, and predicts
x_{i+2} through the shared lm_head; the shared embedding and lm_head get gradients from both losses.

Deterministic (seeded data and init, torch.use_deterministic_algorithms) for a given machine and torch build;
another CPU's float32 kernels may round differently, so the bytes are not portable, the measurements are.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel, Qwen3_5TextRotaryEmbedding

from oracle.families import qwen3_5, torch_parts
from oracle.families.qwen3_5_layout import head_config_from_json

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "qwen3_5_trained"
GENERATED_BY = "python scripts/train_tiny.py"
# Two layers (linear + full attention) keep a training step near 0.1 s; GQA and head_dim 32 != 64/4 as in TINY.
DIMS = {"vocab_size": 96, "num_hidden_layers": 2, "intermediate_size": 128}
LAYER_TYPES = ["linear_attention", "full_attention"]
END, LETTERS, NAMES = 0, range(1, 56), range(56, 96)  # token id ranges of the synthetic language
WORDS_PER_CATEGORY = {"det": 3, "adj": 6, "noun": 10, "verb": 8, "prep": 4}
LEXICON_SEED, TRAIN_SEED, HELDOUT_SEED, INIT_SEED = 11, 12, 13, 14
STEPS, BATCH, SEQ_LEN, LR = 1200, 32, 64, 3e-3
HELDOUT_TOKENS = 200


def make_lexicon(rng: np.random.Generator) -> dict:
    """Word spellings per category, and the verbs each noun allows."""
    words = {cat: [rng.choice(LETTERS, size=rng.integers(2, 5)).tolist() for _ in range(n)]
             for cat, n in WORDS_PER_CATEGORY.items()}
    verbs_of = [rng.choice(WORDS_PER_CATEGORY["verb"], size=3, replace=False).tolist()
                for _ in range(WORDS_PER_CATEGORY["noun"])]
    return {"words": words, "verbs_of": verbs_of}


def sentence(rng: np.random.Generator, lexicon: dict) -> list[int]:
    words = lexicon["words"]

    def pick(cat: str) -> list[int]:
        return words[cat][rng.integers(len(words[cat]))]

    name = rng.choice(NAMES, size=2).tolist()
    noun = int(rng.integers(len(words["noun"])))
    tokens = name + pick("det") + (pick("adj") if rng.random() < 0.5 else []) + words["noun"][noun]
    tokens += words["verb"][int(rng.choice(lexicon["verbs_of"][noun]))]
    if rng.random() < 0.5:
        tokens += pick("prep") + pick("det") + pick("noun")
    return tokens + name + [END]


def token_stream(seed: int, lexicon: dict, length: int) -> np.ndarray:
    """`length` tokens of whole sentences, starting at a sentence start."""
    rng, tokens = np.random.default_rng(seed), []
    while len(tokens) < length:
        tokens += sentence(rng, lexicon)
    return np.array(tokens[:length], dtype=np.int64)


def release_config() -> dict:
    """make_fixtures' release config.json with this model's dims and a full-attention last layer."""
    config = make_fixtures().release_config({**make_fixtures().TINY, **DIMS})
    config["text_config"]["layer_types"] = LAYER_TYPES
    config["_generated_by"] = GENERATED_BY
    return config


class Trained(nn.Module):
    """Main model (official Qwen3_5TextModel), lm_head, and the oracle's own MtpHead with its rotary."""

    def __init__(self, config: dict):
        super().__init__()
        text = Qwen3_5TextConfig(**{k: v for k, v in config["text_config"].items() if k != "model_type"})
        self.main = Qwen3_5TextModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        head_text = qwen3_5.head_text_config(head_config_from_json(config, "train_tiny"))
        self.head = qwen3_5.MtpHead(head_text, qwen3_5.CLASSES)
        self.head_rotary = Qwen3_5TextRotaryEmbedding(head_text)

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Main next-token loss and head next-next-token loss on a batch x (B, T)."""
        b, t = x.shape
        hidden = self.main(input_ids=x).last_hidden_state  # (B, T, D), post-final-norm
        vocab = self.lm_head.out_features
        main_loss = F.cross_entropy(self.lm_head(hidden[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1))
        embed = self.main.embed_tokens(x[:, 1:-1])  # step i reads x_{i+1}: (B, T-2, D)
        positions = torch.arange(t - 2)[None].expand(b, -1)  # (B, T-2)
        rope = self.head_rotary(embed, positions)
        out = self.head(embed, hidden[:, :-2].detach(), rope, torch_parts.causal_mask(t - 2))["out"]
        head_loss = F.cross_entropy(self.lm_head(out).reshape(-1, vocab), x[:, 2:].reshape(-1))
        return main_loss, head_loss


def train(model: Trained, stream: np.ndarray) -> list[tuple[float, float]]:
    """AdamW with linear decay on random windows of the training stream; returns (main, head) loss per step."""
    rng = np.random.default_rng(TRAIN_SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / STEPS)
    history = []
    for step in range(STEPS):
        starts = rng.integers(0, len(stream) - SEQ_LEN, size=BATCH)
        x = torch.from_numpy(np.stack([stream[s:s + SEQ_LEN] for s in starts]))  # (B, T)
        main_loss, head_loss = model.losses(x)
        opt.zero_grad()
        (main_loss + head_loss).backward()
        opt.step()
        sched.step()
        history.append((main_loss.item(), head_loss.item()))
        if step % 100 == 0 or step == STEPS - 1:
            print(f"step {step:4d}  main {main_loss.item():.3f}  head {head_loss.item():.3f}", file=sys.stderr)
    return history


def release_tensors(model: Trained, config: dict) -> dict[str, torch.Tensor]:
    """The trained tensors under the release's names (checked against transformers), plus a tiny vision tower."""
    mf = make_fixtures()
    trained = {f"model.language_model.{k}": v for k, v in model.main.state_dict().items()}
    trained |= {"lm_head.weight": model.lm_head.weight} | {f"mtp.{k}": v for k, v in model.head.state_dict().items()}
    expected = mf.main_model_shapes(config) | mf.mtp_shapes({**mf.TINY, **DIMS})
    wrong = sorted(n for n, t in trained.items() if expected.get(n) != tuple(t.shape))
    untrained = sorted(n for n in expected if n not in trained)
    if wrong or any(not n.startswith("model.visual.") for n in untrained):
        raise RuntimeError(f"names/shapes differ from the release layout: {wrong or untrained}")
    # The vision tower is not trained (text only); it is stored so the layout is the complete release's.
    vision = {n: torch.from_numpy(mf.tensor_values(n, expected[n], seed=0)) for n in untrained}
    return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in sorted((trained | vision).items())}


def write_release(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor], heldout: np.ndarray) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    lines = [" ".join(map(str, heldout[i:i + 20])) for i in range(0, len(heldout), 20)]
    (out_dir / "heldout_tokens.txt").write_text("\n".join(lines) + "\n")


def check_with_oracle(out_dir: Path, heldout: np.ndarray) -> None:
    """Read the fixture back through the oracle and print held-out next-token accuracy and acceptance."""
    from oracle.accept import measure_acceptance
    from oracle.accept_report import summary_line
    from oracle.checkpoint import Checkpoint
    from oracle.export import HiddenSource

    ckpt = Checkpoint(out_dir)
    hidden = qwen3_5.main_model_hidden(qwen3_5.load_main_model(ckpt), heldout)
    logits = hidden @ ckpt.read("lm_head.weight").T  # (N, D) x (D, V) -> (N, V)
    accuracy = float((logits[:-1].argmax(1) == heldout[1:]).mean())
    print(f"held-out next-token accuracy of the main model: {accuracy:.3f}", file=sys.stderr)
    for target in ("greedy", "text"):
        result = measure_acceptance(out_dir, heldout, HiddenSource(main_model=True), k=4, target=target)
        print(summary_line(result), file=sys.stderr)


def make_fixtures():
    """scripts/make_fixtures.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "scripts" / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(INIT_SEED)
    lexicon = make_lexicon(np.random.default_rng(LEXICON_SEED))
    config = release_config()
    model = Trained(config)
    began = time.monotonic()
    history = train(model, token_stream(TRAIN_SEED, lexicon, 200_000))
    seconds = time.monotonic() - began
    config["_training"] = {"steps": STEPS, "batch": BATCH, "seq_len": SEQ_LEN, "lr": LR,
                           "seeds": {"lexicon": LEXICON_SEED, "train": TRAIN_SEED, "heldout": HELDOUT_SEED,
                                     "init": INIT_SEED},
                           "final_loss": {"main": round(history[-1][0], 4), "head": round(history[-1][1], 4)},
                           "head_hidden": "post-final-norm H, detached"}
    heldout = token_stream(HELDOUT_SEED, lexicon, HELDOUT_TOKENS)
    write_release(OUT, config, release_tensors(model, config), heldout)
    print(f"trained in {seconds:.0f} s; wrote {OUT}", file=sys.stderr)
    check_with_oracle(OUT, heldout)


if __name__ == "__main__":
    main()
