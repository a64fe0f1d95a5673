"""The main model's output projection as the acceptance measurement uses it: the exact argmax over the vocabulary.

What is computed. For a float32 row x and the stored lm_head W (bf16, f16 or f32: every stored value is exact in
float32), logit v is the real number t_v = Σ_i x_i·W[v, i], and `argmax` returns argmax_v t_v, ties to the lowest
id. That is "the float32 argmax" made exact: a float32 GEMM rounds each t_v by up to about D·2^-24·Σ|x_i·W[v, i]|,
and how depends on its summation order (numpy's one-shot matmul and a chunked GEMM break an exact tie w[3] == w[70]
differently), so "the argmax of the float32 logits" is not one thing; the exact logits are, and any correct float32
GEMM agrees with them wherever the top two logits are further apart than its rounding.

How, without paying for a float32 GEMM over the whole vocabulary (248320 x 5120 at real scale):

1. Screen. Per vocabulary chunk, s = bf16(x) @ W_chunk^T with oneDNN's bf16 GEMM on the stored bf16 rows as read
   (pread into one reused buffer, no widening; about 5x the float32 GEMM rate on a CPU with AVX512-BF16 or AMX).
   Weights stored as f16/f32 are screened with a float32 GEMM instead (x unrounded, the chunk widened exactly), and
   so are bf16 weights where oneDNN has no bf16 kernel for this CPU (`BF16_SCREEN`: AVX2 only, as some of the
   machines this runs on): torch then falls back to a generic bf16 loop, measured at 1/5 of the float32 GEMM rate
   (19 against 89 GFLOP/s at 504 x 4096 x 8192), and whose accumulation the bound below does not vouch for.
2. Bound. For every v of chunk c, |t_v - s_v| <= A[r, c] + rel·|s_v|, where (u = 2^-24, γ = D·u / (1 - D·u),
   M[c, i] = max_{v in c} |W[v, i]|, computed once per chunk from the stored bits and kept):
   - bf16 screen: x = xb + d, xb = bf16(x), and d = x - xb exactly (Sterbenz). Then
     t_v - s_v = Σ d_i·W[v,i]  (|.| <= Σ |d_i|·M[c,i])                              -- x rounded to bf16
               + (Σ xb_i·W[v,i] - acc_v)  (|.| <= γ·Σ |xb_i|·M[c,i] + φ)           -- float32 accumulation
               + (acc_v - s_v)  (|.| <= 2^-8·|s_v|)                                  -- output rounded to bf16
     The middle term holds for any summation order and blocking, because each bf16 x bf16 product is exact in
     float32 (8 + 8 significand bits) and oneDNN accumulates bf16 matmuls in float32 (its default "strict"
     accumulation mode; relaxed/any, which may round partial sums to bf16, are opt-in attributes torch does not
     set: ONEDNN_VERBOSE=1 shows `brg_matmul:avx512_core_bf16` with no acc-mode attribute). φ = 2^-126·(3D + 2 +
     Σ_i M[c,i] + Σ_i |xb_i|) covers flushed subnormal inputs, products, partial sums and output. The last term is
     round-to-nearest-even to 8 significand bits, |acc - RN(acc)| <= 2^-8·|RN(acc)|. So rel = 2^-8 and
     A = Σ_i (|d_i| + γ·|xb_i|)·M[c,i] + φ.
   - float32 screen: A = γ·Σ_i |x_i|·M[c,i] + φ, rel = 0 (float32 accumulation of exact float32 operands).
   The assumption about the kernel is checked on every call where it can be: each rescored pair must satisfy the
   bound against its float64 logit, or `argmax` raises.
3. Keep. s - rel·|s| - A is increasing in s, so each chunk's top s gives a lower bound L[r] on max_v t_v; v stays a
   candidate only while s_v + rel·|s_v| + A[r, c] >= L[r], i.e. while t_v may still reach the best. Every
   comparison is made in float64 with a margin of 2^-40 of its operands, so float rounding can only keep more.
4. Rescore. Candidates get float64 logits: products of float32 and stored values are exact in float64, the sum is
   within (D+8)·2^-52·Σ|x_i·W[v,i]| of t_v. A row whose best candidate is separated by these bounds is decided;
   otherwise the candidates that may tie are compared exactly: math.fsum is the correctly rounded exact sum
   (monotone), and the sign of fsum(products of a, minus products of b) is the sign of t_a - t_b, because a
   nonzero exact difference is a multiple of 2^-298 and cannot round to zero. Ties go to the lower id.
   If the screen cannot separate anything (e.g. x = 0: every logit ties), every id is a candidate and the row is
   rescored whole: slow, never wrong.

Peak memory is one chunk as stored (read with pread into one reused buffer), its screen scores (rows x chunk, bf16),
the candidates and M (vocab/chunk x D float32).
"""

import math
import os
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError, InputError
from oracle.families.spec import MAIN_LM_HEAD as LM_HEAD

CHUNK_ROWS = 8192  # lm_head rows per screen GEMM (80 MiB of bf16 at real scale, read into one reused buffer);
# measured idle at real scale, 32768-row chunks run the bf16 GEMM only ~3% faster
PAIR_BLOCK = 1024  # (row, id) candidates rescored at a time: 1024 x D float64 products (40 MiB at D=5120)
U32, BF16_REL = 2.0**-24, 2.0**-8
COLMAX_BLOCK_ROWS = 64  # rows per pass of the column maximum (measured: 64 beat 256 and 1024)
FLUSH = 2.0**-126  # the smallest normal float32: a flushed subnormal loses less than this
MARGIN = 2.0**-40  # of each float64 comparison's operands: far above their rounding (2^-52), far below any bound

_TORCH_STORED = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _onednn_runs_bf16() -> bool:
    """Whether torch's bf16 matmul runs on oneDNN's bf16 kernels here (AVX512-BF16 / AMX), the kernels whose
    float32 accumulation the bf16 screen's bound relies on; elsewhere bf16 chunks are widened and screened in
    float32. Only the speed depends on it: both screens give the exact argmax."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: the float32 screen is right everywhere
        return False


BF16_SCREEN = _onednn_runs_bf16()  # tests set it both ways, so each screen runs on any machine


@dataclass(frozen=True)
class LmHead:
    """The main model's output projection, read from the checkpoint a vocabulary chunk at a time."""

    checkpoint: Checkpoint
    name: str
    chunk_rows: int = CHUNK_ROWS
    # the family's draft logits (FamilySpec.draft_logits): lm_head(row / divisor) over the first `vocab_rows` ids
    # (Inkling: the muP width multiplier and the unpadded vocabulary, as MtpModel._project_to_logits)
    divisor: float = 1.0
    vocab_rows: int | None = None
    _column_max: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # chunk start -> M[c]
    _row_norm_sq: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # start -> max ‖w_v‖²

    def argmax(self, rows: np.ndarray) -> np.ndarray:
        """argmax over the full vocabulary (its first `vocab_rows` ids where set) of the exact logits W @ row (row /
        divisor where set) for each float32 row [R, D]; ties go to the lowest id (see the module docstring)."""
        x = self._input(rows)
        if not np.isfinite(x).all():
            raise InputError(f"lm_head argmax: {np.count_nonzero(~np.isfinite(x).all(axis=1))} of {len(x)} rows "
                             f"hold NaN or Inf; their logits have no argmax.")
        if len(x) == 0:
            return np.zeros(0, dtype=np.int64)
        return self._decide(x, self._screen(x))

    def argmax_margin(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(`argmax(rows)`, and per row a lower bound on the exact top-1 logit minus the best other id's logit).

        The screen keeps every id that may be one of the two largest logits (its threshold is a lower bound on the
        second largest, not the largest), so the runner-up is among the candidates; both get float64 logits, and the
        margin is their difference less both float64 error bounds (never above the exact margin; 0 at a tie). A draft
        flip is rounding only where this margin is within what an error in the row could move the logits."""
        x = self._input(rows)
        if not np.isfinite(x).all():
            raise InputError(f"lm_head argmax: {np.count_nonzero(~np.isfinite(x).all(axis=1))} of {len(x)} rows "
                             f"hold NaN or Inf; their logits have no argmax.")
        if len(x) == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        cand = self._screen(x, second=True)
        x64 = x.astype(np.float64)
        logit, err = self._float64_logits(x64, cand.rows, cand.ids)
        ids = self._decide(x, cand, (logit, err), x64)  # the same float64 logits: rescored once, not twice
        best = cand.ids == ids[cand.rows]
        top = np.full(len(x), -np.inf)
        np.maximum.at(top, cand.rows[best], logit[best] - err[best])
        runner = np.full(len(x), -np.inf)
        np.maximum.at(runner, cand.rows[~best], logit[~best] + err[~best])
        margin = np.maximum(top - runner, 0.0).astype(np.float32)  # inf where the vocabulary has one id
        return ids, np.where(np.isinf(margin), margin, np.nextafter(margin, np.float32(0)))  # rounded down

    def _input(self, rows: np.ndarray) -> np.ndarray:
        """The projection's float32 input: the rows, divided by `divisor` in float32 where it is set."""
        x = np.ascontiguousarray(rows, dtype=np.float32)
        return x if self.divisor == 1.0 else x / np.float32(self.divisor)

    def read_ahead(self) -> None:
        """Ask the kernel, on a daemon thread, to bring the stored rows into the page cache (posix_fadvise
        WILLNEED), so that a sweep started later finds them there: the export calls this before its forward, and a
        cold lm_head (2.5 GB at real scale) is then read while the head computes, not while the sweep waits
        (measured here: the column-maximum pass of a cold 27B lm_head was 25x its CPU time in wall time). A hint
        only: where it is not supported or fails, the sweep reads the pages itself, as before."""
        entry = self.checkpoint.entry(self.name)
        if not hasattr(os, "posix_fadvise"):
            return

        def advise() -> None:
            try:
                fd = os.open(entry.file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, entry.offset, entry.nbytes, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            except OSError:
                pass  # the sweep reads the rows regardless

        threading.Thread(target=advise, name="lm_head-read-ahead", daemon=True).start()

    def row_norm_max(self) -> float:
        """The largest L2 norm of a row of the projection, rounded up (float32 sums of squares of D terms err by
        under D·2^-24 relative; 2^-10 covers D < 2^14): a row error of d (L2) moves a logit difference by at most
        2 * row_norm_max * d. The squared norms are taken in the pass that computes each chunk's column maxima
        (`_colmax`), so after a screen this reads nothing; a chunk no screen has read yet is read once here."""
        for start, w in self._chunks(skip=self._row_norm_sq):
            self._colmax(start, w)
        largest = math.sqrt(float(max(self._row_norm_sq.values()))) * (1 + 2.0**-10)
        # per unit of the rows given: a row error d moves the input by d / divisor (rounded up once more)
        return largest if self.divisor == 1.0 else largest / self.divisor * (1 + 2.0**-20)

    # ---- 1-3: screen, bound, keep -------------------------------------------------------------------------------

    def _screen(self, x: np.ndarray, second: bool = False) -> "Candidates":
        """Every (row, id) whose logit may still be its row's maximum (`second`: one of its two largest), with its
        screen score and bound."""
        operand, weight, phi, rel = _screen_operand(x, self._bf16_screen())
        lower = np.full(len(x), -np.inf)  # L[r]: a lower bound on max_v t_v (second: on the second largest t_v)
        best_lower = np.full(len(x), -np.inf)  # second: a lower bound on max_v t_v
        found = []
        for start, w in self._chunks():
            colmax = self._colmax(start, w)
            # A[r, c], (R,). In torch, not numpy: OpenBLAS's threads spin after a numpy matvec and would take the
            # cores from torch's GEMM below (measured: 2x slower sweeps).
            slack = (weight @ torch.from_numpy(colmax).double()).numpy() + phi + FLUSH * float(colmax.sum())
            s = operand @ w.T  # (R, D) x (D, n) -> (R, n)
            if second:  # the two largest lower bounds of distinct ids: ids of one chunk and of different chunks
                pair = torch.topk(s, min(2, s.shape[1]), dim=1).values.double().numpy()
                low = _down(pair - rel * np.abs(pair) - slack[:, None], np.abs(pair) + slack[:, None])
                low2 = low[:, 1] if low.shape[1] > 1 else np.full(len(x), -np.inf)
                lower = np.maximum(np.minimum(best_lower, low[:, 0]), np.maximum(lower, low2))
                best_lower = np.maximum(best_lower, low[:, 0])
                top = pair[:, 0]
            else:
                top = s.amax(dim=1).double().numpy()
                lower = np.maximum(lower, _down(top - rel * np.abs(top) - slack, np.abs(top) + slack))
            theta = _keep_threshold(lower, slack, rel)
            hit = np.flatnonzero(top >= theta)  # rows with a candidate in this chunk: few, once L[r] is high
            sub, ids = (s[hit] >= torch.from_numpy(theta[hit])[:, None]).nonzero(as_tuple=True)
            rows = hit[sub.numpy()]
            found.append((rows, ids.numpy() + start, s[rows, ids].double().numpy(), slack[rows]))
        rows, ids, score, slack = (np.concatenate(part) for part in zip(*found))
        keep = score + rel * np.abs(score) + slack >= _down(lower[rows], np.abs(score) + slack + np.abs(lower[rows]))
        order = np.lexsort((ids[keep], rows[keep]))  # by row, then id
        return Candidates(rows[keep][order], ids[keep][order], score[keep][order], slack[keep][order], rel)

    def _bf16_screen(self) -> bool:
        """Screen with the bf16 GEMM on the stored rows as read (module docstring, 1), not a float32 one."""
        return self.checkpoint.entry(self.name).dtype == "BF16" and BF16_SCREEN

    def _colmax(self, start: int, w: torch.Tensor) -> np.ndarray:
        """M[c, i] = max_v |w[v, i]| of this chunk as float32, from the stored bits, computed once per chunk; the same
        pass keeps the chunk's largest squared row norm for `row_norm_max` (one read of the rows for both)."""
        if start not in self._column_max:
            if w.dtype == torch.bfloat16:
                colmax, norm_sq = _bf16_column_max(w.view(torch.int16).numpy())
            else:
                # max(max, -min) is max |w| exactly, without the |w| temporary (an abs pass cost 3x both reductions)
                colmax = torch.maximum(w.amax(dim=0), -w.amin(dim=0)).numpy().astype(np.float32)
                norm_sq = _row_norm_sq_max(w.numpy())
            if not np.isfinite(colmax).all():
                raise CheckpointError(f"{self.name} rows {start}.. hold NaN or Inf; the argmax of its logits is "
                                      f"undefined.")
            self._column_max[start], self._row_norm_sq[start] = colmax, norm_sq
        return self._column_max[start]

    def _chunks(self, skip=()):
        """(first row, rows [n, D]) per chunk (but those whose first row is in `skip`), each valid until the next is
        asked for: bf16 and f32 as stored, read with pread into one reused buffer (Checkpoint.stored_rows: a shard
        cut short meanwhile is a CheckpointError, where a mapped view's page past the new end was a SIGBUS; a fresh
        chunk per read would pay its page faults each time), f16 (and bf16 where the screen is float32) widened
        exactly into one reused float32 buffer."""
        entry = self.checkpoint.entry(self.name)
        vocab, width = entry.shape
        buffer_rows = min(self.chunk_rows, vocab)
        buffer = np.empty(buffer_rows * entry.nbytes // max(vocab, 1), dtype=np.uint8)  # one chunk's stored bytes
        vocab = min(vocab, self.vocab_rows or vocab)  # the draft logits' ids: the rows past it are padding
        widen = entry.dtype == "F16" or (entry.dtype == "BF16" and not self._bf16_screen())
        wide = torch.empty(buffer_rows, width) if widen else None
        for start in range(0, vocab, self.chunk_rows):
            if start in skip:
                continue
            stored = _as_torch(*self.checkpoint.stored_rows(self.name, start, min(start + self.chunk_rows, vocab),
                                                            into=buffer))
            yield start, wide[: len(stored)].copy_(stored) if wide is not None else stored

    # ---- 4: rescore exactly -------------------------------------------------------------------------------------

    def _decide(self, x: np.ndarray, cand: "Candidates", scored: tuple | None = None,
                x64: np.ndarray | None = None) -> np.ndarray:
        """Per row, the exact argmax among its candidates (which include every id that may be the argmax);
        `scored`: their (float64 logits, error bounds) and `x64` (x widened) where the caller has them already."""
        x64 = x.astype(np.float64) if x64 is None else x64
        logit, err = scored if scored is not None else self._float64_logits(x64, cand.rows, cand.ids)
        broken = np.abs(logit - cand.score) > (cand.slack + cand.rel * np.abs(cand.score) + err) * (1 + MARGIN)
        if broken.any():
            # the screen and the rescoring read the table at different times: a shard rewritten in between breaks
            # the bound too, and is the file's fault (CheckpointError naming it), not the kernel's
            self.checkpoint.check_unchanged()
            raise RuntimeError(f"the lm_head screen's error bound failed on {int(broken.sum())} candidates (e.g. "
                               f"id {cand.ids[broken][0]}): the GEMM kernel does not accumulate as the bound "
                               f"assumes (oracle/lm_head.py docstring); the screen cannot be trusted here.")
        starts = np.searchsorted(cand.rows, np.arange(len(x)))
        assert (np.bincount(cand.rows, minlength=len(x)) > 0).all(), "every row keeps its own top candidate"
        best_low = np.maximum.reduceat(logit - err, starts)  # (R,) a lower bound on each row's maximum
        near = logit + err >= _down(best_low[cand.rows], np.abs(logit) + err + np.abs(best_low[cand.rows]))
        decided = np.bincount(cand.rows[near], minlength=len(x)) == 1
        ids = np.zeros(len(x), dtype=np.int64)
        ids[cand.rows[near & decided[cand.rows]]] = cand.ids[near & decided[cand.rows]]
        ends = np.append(starts[1:], len(cand.rows))
        for r in np.flatnonzero(~decided):
            mine = np.arange(starts[r], ends[r])[near[starts[r]:ends[r]]]
            ids[r] = self._exact_best(x64[r], cand.ids[mine], err[mine] == 0, logit[mine])
        return ids

    def _float64_logits(self, x64: np.ndarray, rows: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Float64 logits of (row, id) pairs and bounds on their distance to the exact logits."""
        logit, err = np.empty(len(ids)), np.empty(len(ids))
        bound = (x64.shape[1] + 8) * 2.0**-52  # >= 2·γ_D for float64: any summation order, plus the |.| sum's own
        for a in range(0, len(ids), PAIR_BLOCK):
            products = x64[rows[a:a + PAIR_BLOCK]]  # (P, D), a copy: the products are taken in place
            products *= self._rows64(ids[a:a + PAIR_BLOCK])  # exact
            logit[a:a + PAIR_BLOCK] = products.sum(axis=1)
            err[a:a + PAIR_BLOCK] = np.abs(products, out=products).sum(axis=1) * bound
        return logit, err

    def _exact_best(self, x64: np.ndarray, ids: np.ndarray, exact: np.ndarray, logit: np.ndarray) -> int:
        """The exact argmax (lowest id on ties) among ids [ascending] that float64 could not separate."""
        if exact.all():  # every product 0: the float64 logits are the exact ones
            return int(ids[np.argmax(logit)])
        products = x64 * self._rows64(ids)  # (n, D): exact
        rounded = np.array([math.fsum(p) for p in products])  # correctly rounded exact sums: monotone in t
        best = None
        for i in np.flatnonzero(rounded == rounded.max()):  # the exact argmax is among these
            if best is None or math.fsum(np.concatenate([products[i], -products[best]])) > 0:
                best = i  # strictly greater: an equal exact logit keeps the lower id
        return int(ids[best])

    def _rows64(self, ids: np.ndarray) -> np.ndarray:
        """Stored rows `ids` widened exactly to float64 [n, D]."""
        return _as_torch(*self.checkpoint.stored_rows_at(self.name, ids)).double().numpy()  # pread, row by row


def _as_torch(stored: np.ndarray, dtype: str) -> torch.Tensor:
    """Stored rows as a torch tensor of their own dtype, no copy (bf16 comes as uint16 bit patterns)."""
    if dtype == "BF16":
        return torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(stored)


@dataclass(frozen=True)
class Candidates:
    """(row, id) pairs that may hold their row's maximum logit, by row then id: screen score and its bound."""

    rows: np.ndarray
    ids: np.ndarray
    score: np.ndarray  # s (float64, exact copy of the screen's output)
    slack: np.ndarray  # A[r, c]: |t - s| <= slack + rel·|s|
    rel: float


def _screen_operand(x: np.ndarray, bf16: bool) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, float]:
    """(screen operand, weight of M in A [R, D] float64, φ [R], rel) for float32 rows x (module docstring, 2)."""
    d = x.shape[1]
    gamma = d * U32 / (1 - d * U32)
    xt = torch.from_numpy(x)
    if not bf16 and torch.get_float32_matmul_precision() != "highest":
        raise RuntimeError("the float32 lm_head screen needs torch.set_float32_matmul_precision('highest'): "
                           "lower settings let the GEMM round its operands, which its bound does not cover.")
    operand = xt.bfloat16() if bf16 else xt
    kept = operand.float().numpy()
    if bf16 and not np.isfinite(kept).all():
        raise InputError("lm_head argmax: a row holds a value beyond the bf16 range (3.4e38).")
    # (R, D) float64, built in place: |x - kept| (exact: x and its rounding are within a factor 2, Sterbenz)
    # + gamma·|kept| (in float64: a float32 product could round below gamma·|kept|), then (1 + 2^-30) for A's own
    # float64 rounding (D < 2^22)
    weight = np.abs(x - kept, dtype=np.float64)
    magnitude = np.abs(kept, dtype=np.float64)
    phi = FLUSH * (3 * d + 2 + magnitude.sum(axis=1))
    magnitude *= gamma
    weight += magnitude
    del magnitude
    weight *= 1 + 2.0**-30
    weight = torch.from_numpy(weight)
    return operand, weight, phi, BF16_REL if bf16 else 0.0


def _bf16_column_max(bits: np.ndarray, block: int = COLMAX_BLOCK_ROWS) -> tuple[np.ndarray, np.float32]:
    """(max_v |w[v, i]| as float32, max_v ‖w_v‖² as float32) for bf16 bit patterns [n, D] (int16: sign | exponent |
    mantissa), in one pass over the rows.

    Clearing the sign bit gives |w|'s pattern, and for non-negative bf16 the pattern's order is the value's order
    (NaN patterns sort above Inf, so a NaN column stays NaN). Done `block` rows at a time into a buffer that stays
    in cache: one pass over the stored rows instead of two (the signed and the unsigned maximum), 0.59 -> 0.35 s
    over a 248320 x 5120 lm_head here (bench: `scripts/bench.py --only accept`). The same block, widened exactly
    to float32 (its bits in the top half), gives the rows' squared norms while it is in cache: `row_norm_max` no
    longer reads the lm_head a second time (a separate torch vector_norm pass cost more than the screen's GEMM)."""
    magnitude = np.zeros(bits.shape[1], dtype=np.int16)
    scratch = np.empty((min(block, len(bits)), bits.shape[1]), dtype=np.int16)
    wide = np.empty(scratch.shape, dtype=np.int32)
    norm_sq = np.float32(0)
    for start in range(0, len(bits), block):
        rows = scratch[: min(block, len(bits) - start)]
        np.bitwise_and(bits[start:start + block], 0x7FFF, out=rows)
        np.maximum(magnitude, rows.max(axis=0), out=magnitude)
        widened = wide[: len(rows)]
        np.left_shift(rows, 16, out=widened, dtype=np.int32, casting="unsafe")  # |w| as float32 bits: exact
        norm_sq = max(norm_sq, _row_norm_sq_max(widened.view(np.float32)))
    return (magnitude.astype(np.uint32) << 16).view(np.float32), norm_sq


def _row_norm_sq_max(rows: np.ndarray) -> np.float32:
    """max_v Σ_i w[v, i]² of float32 rows [n, D] (the squares are exact for bf16 and f16 values; the float32 sum
    errs by under D·2^-24 relative in any order, which `row_norm_max` rounds up for). numpy's own loop, not a BLAS
    call: deterministic, and no OpenBLAS threads left spinning against torch's GEMM."""
    if len(rows) == 0:
        return np.float32(0)
    return np.einsum("ij,ij->i", rows, rows).max()


def _down(value: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """`value` lowered by a margin far above the float64 rounding of operands of size `scale`."""
    return value - MARGIN * scale - 2.0**-1000


def _keep_threshold(lower: np.ndarray, slack: np.ndarray, rel: float) -> np.ndarray:
    """Per row, a float32 θ such that s >= θ for every s with s + rel·|s| + slack >= lower."""
    y = lower - slack
    theta = np.where(y >= 0, y / (1 + rel), y / (1 - rel))  # s + rel·|s| is increasing: its inverse at y
    theta = _down(theta, np.abs(lower) + slack + np.abs(theta))
    return np.nextafter(theta.astype(np.float32), np.float32(-np.inf))  # rounded down


def lm_head_of(ckpt: Checkpoint, chunk_rows: int = CHUNK_ROWS) -> LmHead:
    """The checkpoint's lm_head (or the embedding, where config.json ties them), shape-checked."""
    if chunk_rows < 1:
        raise InputError(f"--chunk-rows {chunk_rows}: read at least 1 lm_head row at a time (default {CHUNK_ROWS}).")
    text = ckpt.raw_config.get("text_config", {})
    tied = bool(text.get("tie_word_embeddings", ckpt.raw_config.get("tie_word_embeddings", False)))
    if LM_HEAD in ckpt.names():
        name = LM_HEAD
    elif tied:
        name = ckpt.main_model_prefix() + ckpt.family.embedding
    else:
        raise CheckpointError(f"{ckpt.path} has no {LM_HEAD}, and config.json does not tie it to the embedding "
                              f"(tie_word_embeddings). Acceptance needs the main model's output projection: "
                              f"every draft is its argmax. Copy the complete checkpoint.")
    cfg, entry = ckpt.config, ckpt.entry(name)
    if entry.dtype not in _TORCH_STORED:
        raise CheckpointError(f"{name} is {entry.dtype}; acceptance reads {', '.join(_TORCH_STORED)}.")
    shape = tuple(entry.shape)
    if shape != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"{name} has shape {list(shape)}; config.json implies "
                              f"[{cfg.vocab_size}, {cfg.hidden_size}] (vocab_size, hidden_size).")
    return LmHead(ckpt, name, chunk_rows)
