"""FLOP model of one DPO training step: the speedup a perfect implementation of the counted work would get.

Units follow `trl.trainer.utils.compute_flops_per_token` (attention + MLP matmuls, non-causal attention scores, the
LM head as a 2*hidden*vocab matmul), split into the two parts pruning acts on separately:

- body FLOPs per executed token (every transformer layer), for a row padded to `seq_len`;
- head FLOPs per scored position (2 * hidden * vocab).

Per step:

    forward            body(policy tokens) + head(policy positions)
    backward           2 * [body(grad tokens) + head(grad positions)]
    head recompute     head(grad positions)   TRL's chunked LM head rebuilds each logits tile in its backward
    checkpointing      body(grad tokens)      one more body forward of the backpropagated rows
    live reference     body(reference tokens) + head(reference positions)

Stock TRL on CPU scores every position of every row (prompt and padding included); on Triton devices only the
response positions. Branch pruning at 0.5 (live reference, checkpointing, head ignored) is 10 forward-units for stock
and 7 pruned (limit 1.43x); with precomputed reference 8 and 5 (1.6x) -- `tests/test_benchmarks_smoke.py` checks it.
The optimizer step, embeddings, norms and element-wise ops are left out: they are the same on both sides, so the
limit is an upper bound that a real implementation approaches as the matmuls dominate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> "Shape":
        h = config.hidden_size
        heads = config.num_attention_heads
        return cls(
            hidden=h,
            layers=config.num_hidden_layers,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or h // heads,
            vocab=config.vocab_size,
        )

    def body_per_token(self, seq_len: float) -> float:
        """Forward FLOPs of the transformer layers for one token of a row padded to `seq_len`."""
        h, d = self.hidden, self.head_dim
        qkv = 2 * h * (self.heads * d + 2 * self.kv_heads * d)
        o_proj = 2 * self.heads * d * h
        scores = 2 * 2 * self.heads * d * seq_len
        mlp = 2 * 3 * h * self.intermediate
        return self.layers * (qkv + o_proj + scores + mlp)

    def head_per_position(self) -> float:
        """Forward FLOPs of the LM head for one scored position."""
        return 2 * self.hidden * self.vocab

    def head_share(self, seq_len: float) -> float:
        """LM head share of the forward FLOPs of one token (what position pruning can act on)."""
        head = self.head_per_position()
        return head / (head + self.body_per_token(seq_len))


@dataclass
class Work:
    """What one training step executes, in tokens and positions (all counts are per step, summed over rows)."""

    policy_rows: float
    policy_tokens: float  # executed through the body, padding included
    policy_positions: float  # scored by the LM head
    grad_rows: float
    grad_tokens: float  # of policy_tokens, in the backpropagated group
    grad_positions: float  # of policy_positions, in the backpropagated group
    reference_rows: float = 0
    reference_tokens: float = 0.0
    reference_positions: float = 0.0
    full_tokens: float = 0.0  # stock's 2B x T, the denominator of the logged fractions
    response_positions: float = 0.0
    needed_tokens: float = 0.0  # tokens the rows need without padding (what a packed batch would execute)

    def as_dict(self) -> dict:
        return asdict(self)


def _seq(tokens: float, rows: int) -> float:
    return tokens / rows if rows else 0.0


def step_flops(shape: Shape, work: Work, checkpointing: bool, *, head_recompute: bool = True) -> dict:
    """FLOPs of one step, by component (and `total`)."""
    nograd_rows = work.policy_rows - work.grad_rows
    nograd_tokens = work.policy_tokens - work.grad_tokens
    body_grad = work.grad_tokens * shape.body_per_token(_seq(work.grad_tokens, work.grad_rows))
    body_nograd = nograd_tokens * shape.body_per_token(_seq(nograd_tokens, nograd_rows))
    head = shape.head_per_position()
    out = {
        "forward": body_grad + body_nograd + head * work.policy_positions,
        "backward": 2 * (body_grad + head * work.grad_positions),
        "head_recompute": head * work.grad_positions if head_recompute else 0.0,
        "checkpointing": body_grad if checkpointing else 0.0,
        "reference": work.reference_tokens
        * shape.body_per_token(_seq(work.reference_tokens, work.reference_rows))
        + head * work.reference_positions,
    }
    out["total"] = sum(out.values())
    return out


def stock_work(batch, *, live_reference: bool, compact_head: bool) -> Work:
    """Stock TRL's work on one collated batch: every row with grad; the head scores every position unless compacted
    (Triton devices), where it scores the response positions only."""
    input_ids = batch["input_ids"]
    rows, seq_len = input_ids.shape
    response = float(batch["completion_mask"][:, 1:].sum())
    positions = response if compact_head else float(rows * (seq_len - 1))
    tokens = float(rows * seq_len)
    return Work(
        policy_rows=rows,
        policy_tokens=tokens,
        policy_positions=positions,
        grad_rows=rows,
        grad_tokens=tokens,
        grad_positions=positions,
        reference_rows=rows if live_reference else 0,
        reference_tokens=tokens if live_reference else 0.0,
        reference_positions=positions if live_reference else 0.0,
        full_tokens=tokens,
        response_positions=response,
        needed_tokens=float(batch["attention_mask"].sum()),
    )


def pruned_work(
    stats: dict, *, live_reference: bool, grad_positions: float | None = None, needed_tokens: float = 0.0
) -> Work:
    """The pruned trainer's work from `trainer.last_prune_stats`.

    The backpropagated share of the scored positions is `grad_positions_scored` when the trainer reports it, else
    `grad_positions` (the caller counts it from the masks), else estimated as the backpropagated share of the rows.
    """
    rows = int(stats["rows"])
    grad_rows = int(stats["grad_rows"])
    positions = float(stats["positions_scored"])
    if "grad_positions_scored" in stats:
        grad_positions = float(stats["grad_positions_scored"])
    elif grad_positions is None:
        grad_positions = positions * grad_rows / rows if rows else 0.0
    reference_tokens = float(stats.get("reference_tokens_executed", 0.0)) if live_reference else 0.0
    return Work(
        policy_rows=rows,
        policy_tokens=float(stats["policy_tokens_executed"]),
        policy_positions=positions,
        grad_rows=grad_rows,
        grad_tokens=float(stats["grad_tokens_executed"]),
        grad_positions=grad_positions,
        reference_rows=rows if live_reference and reference_tokens else 0,
        reference_tokens=reference_tokens,
        reference_positions=float(stats.get("reference_positions_scored", 0.0)) if live_reference else 0.0,
        full_tokens=float(stats["full_tokens"]),
        response_positions=float(stats["response_positions"]),
        needed_tokens=needed_tokens,
    )


def mean_work(works: list[Work]) -> Work:
    """Average work over steps (the pruned side's work changes from step to step)."""
    n = len(works)
    fields = Work.__dataclass_fields__
    return Work(**{k: sum(getattr(w, k) for w in works) / n for k in fields})


def mean_flops(shape: Shape, works: list[Work], checkpointing: bool) -> dict:
    """Per-step FLOPs averaged over steps (computed per step: attention depends on each step's padded length)."""
    per_step = [step_flops(shape, w, checkpointing) for w in works]
    return {k: sum(f[k] for f in per_step) / len(per_step) for k in per_step[0]}
