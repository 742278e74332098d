"""Drawing the position, prefix and branch masks, and their inclusion probabilities.

Pure functions of tensors, no trainer state. Everything works in TRL's *shifted* coordinates: column j of a per-token
tensor of shape (rows, seq_len - 1) is the log-prob of input token j + 1, and `response = completion_mask[:, 1:]`
marks the response positions. Rows are TRL's stacked batch: [chosen_0..chosen_{B-1}; rejected_0..rejected_{B-1}].
Equations refer to docs/method.md.
"""

import hashlib
import math
from dataclasses import dataclass, fields

import torch
from torch.nn import functional as F


def mask_generator(seed: int, step: int, micro_step: int, rank: int) -> torch.Generator:
    """A dedicated CPU generator fixed by (seed, global step, micro-step, rank); the global RNG is never touched."""
    digest = hashlib.sha256(f"trl-pruned-dpo:{seed}:{step}:{micro_step}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def response_index(response: torch.Tensor) -> torch.Tensor:
    """1-based index t of each response position within its row (0 outside the response)."""
    return response.long().cumsum(dim=1) * response.long()


def shortest_prefix(lengths: torch.Tensor, min_ratio: float) -> torch.Tensor:
    """k0 = ceil(min_ratio * L), at least 1 for a non-empty response (round-off guarded: 0.7 * 10 is 7, not 8)."""
    k0 = torch.tensor([math.ceil(round(min_ratio * int(n), 9)) for n in lengths.tolist()], dtype=torch.long)
    return torch.clamp(k0, min=1).minimum(lengths.cpu().long().clamp(min=1))


def prefix_inclusion_prob(response: torch.Tensor, prune_prob: float, min_ratio: float) -> torch.Tensor:
    """q_t = P(K >= t) = (1 - p) + p * P(U >= t), U uniform on [k0, L] (Eq. 2); 0 outside the response."""
    t = response_index(response).cpu()
    lengths = response.sum(dim=1).cpu().long()
    k0 = shortest_prefix(lengths, min_ratio)
    L, k0 = lengths.unsqueeze(1), k0.unsqueeze(1)
    tail = (L - t + 1).double() / (L - k0 + 1).clamp(min=1).double()
    p_uniform_ge_t = torch.where(t <= k0, torch.ones_like(tail), tail)
    q = (1.0 - prune_prob) + prune_prob * p_uniform_ge_t
    return torch.where(t > 0, q, torch.zeros_like(q)).to(response.device)


def draw_prefix_keep(
    response: torch.Tensor, prune_prob: float, min_ratio: float, generator: torch.Generator
) -> torch.Tensor:
    """Boolean (rows, cols): response token t survives iff t <= K, K = L with prob. 1 - p, else uniform on [k0, L].

    One coin and one uniform are shared by every row of the micro-batch, each row keeping its own bounds [k0, L]:
    each row's K has exactly the distribution above (so q_t, Eq. 2, is unchanged), and when rows are cut they are cut
    together, so the padded batch really gets shorter. Independent cuts would almost always leave one uncut row that
    sets the width of the executed batch (measured: 0.98 of the tokens executed instead of 0.85).
    """
    t = response_index(response).cpu()
    lengths = response.sum(dim=1).cpu().long()
    k0 = shortest_prefix(lengths, min_ratio)
    cut = torch.rand(1, generator=generator) < prune_prob
    u = torch.rand(1, generator=generator)
    uniform_k = k0 + torch.floor(u * (lengths - k0 + 1).double()).long().minimum(lengths - k0)
    k = torch.where(cut, uniform_k, lengths)
    return ((t > 0) & (t <= k.unsqueeze(1))).to(response.device)


def pair_probs(keep_prob: float | torch.Tensor, num_pairs: int) -> torch.Tensor:
    """A keep probability as a (num_pairs,) float64 tensor: a float is the same for every pair; a tensor has one
    value per pair (trl_pruned_dpo/auto.py). Either way it is fixed before the draw it weights."""
    if torch.is_tensor(keep_prob):
        if keep_prob.shape != (num_pairs,):
            raise ValueError(f"A per-pair keep probability needs shape ({num_pairs},), got {tuple(keep_prob.shape)}.")
        return keep_prob.detach().cpu().double()
    return torch.full((num_pairs,), float(keep_prob), dtype=torch.float64)


def prunes(keep_prob: float | torch.Tensor) -> bool:
    """Whether a keep probability (float or per-pair tensor) drops anything."""
    return bool((keep_prob < 1).any()) if torch.is_tensor(keep_prob) else keep_prob < 1


def draw_positions(response: torch.Tensor, keep_prob: float | torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Boolean (rows, cols): m_t ~ Bernoulli(keep_prob) on response positions (Eq. 1), one draw per pair.

    The chosen and the rejected row of a pair share their draws position by position (their responses start at the
    same column): each row's mask has exactly the law of Eq. 1, but aligned tokens of the two branches, whose
    log-ratios nearly agree on near-copy pairs, are kept or dropped together, so their noise cancels in D^_w - D^_l.
    `keep_prob` is a float or a per-pair tensor (both rows of pair i use its value).
    """
    pairs = response.size(0) // 2
    u = torch.rand((pairs, response.size(1)), generator=generator)
    p = pair_probs(keep_prob, pairs).float().unsqueeze(1)
    return torch.cat([u, u]).lt(torch.cat([p, p])).to(response.device) & response.bool()


def draw_branches(num_pairs: int, keep_prob: float | torch.Tensor, sampling: str,
                  generator: torch.Generator) -> torch.Tensor:
    """Boolean (2 * num_pairs,): z_b, whether each row ([chosen; rejected]) is backpropagated. P(z_b = 1) = keep_prob.

    "paired" stratifies per pair: for p >= 1/2 one branch (a fair coin picks which) always and the other with
    probability 2p - 1; for p < 1/2 one branch with probability 2p, else none. "independent": z_b ~ Bernoulli(p).
    `keep_prob` is a float or a per-pair tensor (pair i's two rows use its value); the same uniforms are drawn either
    way, so a constant tensor draws exactly what its float does.
    """
    p = pair_probs(keep_prob, num_pairs)
    if sampling == "independent":
        return torch.rand(2 * num_pairs, generator=generator) < torch.cat([p, p])
    if sampling != "paired":
        raise ValueError(f"Unknown branch_sampling {sampling!r}")
    first_is_chosen = torch.rand(num_pairs, generator=generator) < 0.5
    u = torch.rand(num_pairs, generator=generator).double()
    high = p >= 0.5
    first = high | (u < 2 * p)
    second = high & (u < 2 * p - 1)
    chosen = torch.where(first_is_chosen, first, second)
    rejected = torch.where(first_is_chosen, second, first)
    return torch.cat([chosen, rejected])


def identical_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(rows,) long: for each row, the first row of the batch holding the same real tokens (itself if none). Such rows
    (one response in several pairs of a prompt group) run once (packing.py), so they are backpropagated together."""
    rows, width = input_ids.shape
    offset = attention_mask.long().argmax(dim=1) if attention_mask is not None else input_ids.new_zeros(rows)
    real = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    ends = real.sum(dim=1, keepdim=True) if attention_mask is not None else torch.full((rows, 1), width)
    ids = torch.where(torch.arange(width, device=input_ids.device) < ends, from_first_real(input_ids, offset), -1)
    _, inverse = torch.unique(ids.cpu(), dim=0, return_inverse=True)
    return torch.full((rows,), rows, dtype=torch.long).scatter_reduce(0, inverse, torch.arange(rows), "amin")[inverse]


def pair_agreement(input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(pairs, cols) bool: column by column, whether the chosen and the rejected row of a pair hold the same token with
    the same `mask` value. Every chosen/rejected alignment of the package (the common prefix, the shared tokens of the
    packed layout, auto's near-copy overlap) reads this one comparison."""
    ids_w, ids_l = input_ids.chunk(2)
    mask_w, mask_l = mask.bool().chunk(2)
    return (ids_w == ids_l) & (mask_w == mask_l)


def from_first_real(x: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Each row of `x` (rows, cols) read from its column `offset` on (its first real token), moved to column 0; past
    the row's end, its last column repeated."""
    cols = torch.arange(x.size(1), device=x.device)
    return x.gather(1, (offset[:, None] + cols).clamp(max=x.size(1) - 1))


def common_prefix(input_ids: torch.Tensor, response: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean (rows, cols): the response tokens that chosen and rejected share at their start, in both rows.

    A pair's rows are compared token by token from their first real token (`attention_mask`; column 0 without it, so
    a left-padding collator's rows align too): a leading run of equal tokens with equal roles, prompt included, means
    same token *and* same context, so the log-ratio of such a response token is the same in both branches.
    """
    rows, width = input_ids.shape
    offset = attention_mask.long().argmax(dim=1) if attention_mask is not None else input_ids.new_zeros(rows)
    cols = torch.arange(width, device=input_ids.device)
    roles = from_first_real(F.pad(response.bool(), (1, 0)), offset) & (offset[:, None] + cols < width)
    run = pair_agreement(from_first_real(input_ids, offset), roles).long().cumprod(dim=1).bool()
    common = torch.cat([run, run]) & roles
    # Grid column c holds real token c - offset.
    back = (cols - offset[:, None]).clamp(min=0)
    return (common.gather(1, back) & (cols >= offset[:, None]))[:, 1:]


# Pairs whose responses agree on at least this fraction of aligned positions keep both branches.
NEAR_COPY = 0.5


def pair_overlap(input_ids: torch.Tensor, completion_mask: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(pairs,) fraction of the longer response's positions where chosen and rejected hold the same token after the
    same token, counted from each row's first real token (`attention_mask`; column 0 without it), where a pair's
    responses start alike. Near-copies ~1; two independent answers ~0, even where separators happen to line up (the
    preceding token then differs)."""
    # A left-padding collator's rows, aligned as common_prefix aligns them.
    if attention_mask is not None:
        offset = attention_mask.long().argmax(dim=1)
        cols = torch.arange(input_ids.size(1), device=input_ids.device)
        input_ids = from_first_real(input_ids, offset)
        completion_mask = from_first_real(completion_mask, offset) * (offset[:, None] + cols < input_ids.size(1))
    agree = pair_agreement(input_ids, completion_mask)
    resp_w, resp_l = completion_mask[:, 1:].bool().chunk(2)
    same = (agree[:, 1:] & agree[:, :-1] & resp_w).sum(dim=1).double()
    longer = torch.maximum(resp_w.sum(dim=1), resp_l.sum(dim=1)).clamp(min=1).double()
    return (same / longer).cpu()


def per_pair_branch_probs(overlap: torch.Tensor, keep_prob: float) -> torch.Tensor:
    """Near-copies (overlap >= NEAR_COPY) keep both branches; every other pair gets `keep_prob`."""
    return torch.where(overlap >= NEAR_COPY, torch.ones_like(overlap), torch.full_like(overlap, keep_prob))


def positions_needed(scored: torch.Tensor) -> torch.Tensor:
    """(rows,) long: input positions a row must run to score its last scored column c (c + 1; 0 if none). Column c
    is the log-prob of token c + 1, which position c predicts."""
    if not scored.numel():
        return torch.zeros(scored.size(0), dtype=torch.long, device=scored.device)
    cols = torch.arange(1, scored.size(1) + 1, device=scored.device)
    return (scored.long() * cols).amax(dim=1)


def executed_columns(scored: torch.Tensor) -> torch.Tensor:
    """(rows,) input columns each row must execute when its labels come from its own input (the unshared forward):
    the positions needed and the token the last one predicts (0 if none)."""
    needed = positions_needed(scored)
    return needed + (needed > 0).long()


@dataclass
class PruneMasks:
    """One draw of the three masks for a stacked batch, in shifted coordinates.

    scored:      (rows, cols) bool, positions that go through the LM head
    weights:     (rows, cols) float, 1 / (p_pos * q_t) on scored positions, 0 elsewhere (Eqs. 1-2)
    executed:    (rows,) long, input columns each row must execute: up to its last scored token (0 if none)
    backprop:    (rows,) bool, z_b: rows whose forward keeps activations and gets a backward
    branch_scale:(rows,) float, z_b / p_br (Eq. 3)
    exact:       (rows, cols) bool, what an unpruned computation scores: the response, less the common prefix if
                 that is dropped (it cancels exactly, so it is not a sample)
    """

    scored: torch.Tensor
    weights: torch.Tensor
    executed: torch.Tensor
    backprop: torch.Tensor
    branch_scale: torch.Tensor
    exact: torch.Tensor

    def to(self, device: torch.device | str) -> "PruneMasks":
        """The masks on `device` (a copy; a no-op for tensors already there)."""
        return PruneMasks(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))


def draw_masks(
    input_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    position_keep_prob: float | torch.Tensor,
    prefix_prune_prob: float,
    prefix_min_ratio: float,
    branch_keep_prob: float | torch.Tensor,
    branch_sampling: str,
    drop_common_prefix: bool,
    generator: torch.Generator,
    attention_mask: torch.Tensor | None = None,
) -> PruneMasks:
    """Draw all masks for one micro-batch. With every probability at its identity value, nothing is pruned.

    `position_keep_prob` and `branch_keep_prob` are floats or per-pair (rows // 2,) tensors (Eqs. 1 and 3 with pair i's
    own probability: the weights and branch scales are per pair too).
    """
    response = completion_mask[:, 1:].bool()
    rows = response.size(0)
    exact = response & ~common_prefix(input_ids, response, attention_mask) if drop_common_prefix else response
    keep = exact.clone()
    q = torch.ones(response.shape, dtype=torch.float64, device=response.device)
    if prefix_prune_prob > 0:
        keep &= draw_prefix_keep(response, prefix_prune_prob, prefix_min_ratio, generator)
        q = prefix_inclusion_prob(response, prefix_prune_prob, prefix_min_ratio)
    if prunes(position_keep_prob):
        keep &= draw_positions(response, position_keep_prob, generator)
    pairs = rows // 2
    p_pos = pair_probs(position_keep_prob, pairs).to(response.device)
    inclusion = q * torch.cat([p_pos, p_pos]).unsqueeze(1)
    weights = torch.where(keep, 1.0 / inclusion.clamp(min=1e-12), torch.zeros_like(inclusion)).float()
    executed = executed_columns(keep)
    p_branch = pair_probs(branch_keep_prob, pairs).to(response.device)
    p_row = torch.cat([p_branch, p_branch])
    if prunes(branch_keep_prob):
        backprop = draw_branches(pairs, branch_keep_prob, branch_sampling, generator).to(response.device)
        # a response in several pairs is one branch: its first row's draw and probability for all (Eq. 3 per row,
        # E[z / p] = 1 still); with no repeated row, the draw above unchanged (docs/method.md, "Prompt groups")
        same = identical_rows(input_ids, attention_mask).to(response.device)
        backprop, p_row = backprop[same], p_row[same]
    else:
        backprop = torch.ones(rows, dtype=torch.bool, device=response.device)
    branch_scale = (backprop.double() / p_row).float()
    return PruneMasks(keep, weights, executed, backprop, branch_scale, exact)
