"""The mask sampling of masks.py, against its contract (docs/method.md, Eqs. 1-3)."""

import math

import pytest
import torch

from trl_pruned_dpo.method.masks import (
    common_prefix,
    draw_branches,
    draw_masks,
    draw_positions,
    draw_prefix_keep,
    mask_generator,
    prefix_inclusion_prob,
)


def response_of(lengths, width=None, start=2):
    width = width or start + max(lengths) + 1
    response = torch.zeros(len(lengths), width, dtype=torch.bool)
    for r, n in enumerate(lengths):
        response[r, start : start + n] = True
    return response


def draws(fn, n, seed=0):
    return torch.stack([fn(mask_generator(seed, step, 0, 0)) for step in range(n)]).double()


def assert_close_mc(empirical_mean, exact, n, what):
    """Mean of n Bernoulli draws vs its probability, within 5 standard errors (plus float slack)."""
    se = torch.sqrt(exact * (1 - exact) / n) + 1e-9
    z = ((empirical_mean - exact).abs() / se).max().item()
    assert z < 5, f"{what}: max |z| = {z:.1f}"


def test_prefix_inclusion_probability_is_exact():
    """q_t = (1 - p) + p * P(U >= t): computed by hand for L = 4, r_min = 0.5, p = 0.5: k0 = 2, U on {2, 3, 4}."""
    q = prefix_inclusion_prob(response_of([4], start=0), prune_prob=0.5, min_ratio=0.5)[0, :4]
    expected = torch.tensor([1.0, 1.0, 0.5 + 0.5 * 2 / 3, 0.5 + 0.5 * 1 / 3], dtype=q.dtype)
    torch.testing.assert_close(q, expected)


def test_prefix_keep_frequencies_match_inclusion_probabilities():
    response = response_of([1, 5, 17, 40])
    n = 4000
    keeps = draws(lambda g: draw_prefix_keep(response, 0.6, 0.3, g), n)
    q = prefix_inclusion_prob(response, 0.6, 0.3)
    assert_close_mc(keeps.mean(0)[response], q[response], n, "prefix inclusion")
    assert (keeps.sum(0)[~response] == 0).all()  # never outside the response


def test_prefix_keeps_a_prefix_at_least_min_ratio_long():
    response = response_of([10, 7])
    for step in range(200):
        keep = draw_prefix_keep(response, 1.0, 0.7, mask_generator(0, step, 0, 0))
        for r, n in enumerate([10, 7]):
            kept = keep[r][response[r]]
            k = int(kept.sum())
            assert kept[:k].all() and not kept[k:].any()  # a prefix
            assert k >= math.ceil(0.7 * n - 1e-9)  # 0.7 * 10 is 7, not 8


def test_position_frequencies():
    response = response_of([30, 3])
    n = 3000
    kept = draws(lambda g: draw_positions(response, 0.3, g), n)
    assert_close_mc(kept.mean(0)[response], torch.full((33,), 0.3, dtype=torch.float64), n, "position")
    assert (kept.sum(0)[~response] == 0).all()


def test_position_masks_are_shared_within_a_pair():
    """Common random numbers: aligned positions of chosen and rejected are kept together (same marginal law)."""
    response = response_of([6, 9, 9, 4])  # pairs (row 0, row 2) and (row 1, row 3)
    kept = draw_positions(response, 0.5, mask_generator(0, 0, 0, 0))
    both = response[:2] & response[2:]
    assert torch.equal(kept[:2] & both, kept[2:] & both)


@pytest.mark.parametrize("p", [0.25, 0.5, 0.8])
@pytest.mark.parametrize("sampling", ["paired", "independent"])
def test_branch_inclusion_probability(p, sampling):
    n, pairs = 3000, 3
    z = draws(lambda g: draw_branches(pairs, p, sampling, g), n)
    assert_close_mc(z.mean(0), torch.full((2 * pairs,), p, dtype=torch.float64), n, "branch")


def test_paired_sampling_is_stratified():
    """At 0.5 exactly one branch per pair; above, at least one; below, at most one (fixed cost per step)."""
    for p, low, high in [(0.5, 1, 1), (0.8, 1, 2), (0.3, 0, 1)]:
        for step in range(100):
            z = draw_branches(4, p, "paired", mask_generator(1, step, 0, 0))
            per_pair = z[:4].long() + z[4:].long()
            assert ((per_pair >= low) & (per_pair <= high)).all()


def test_masks_are_reproducible_and_differ_by_step_micro_step_and_rank():
    response = response_of([50] * 4)
    ids = torch.randint(5, 50, response.shape)
    completion = torch.cat([torch.zeros(4, 1, dtype=torch.long), response.long()], 1)
    ids = torch.cat([ids, ids[:, :1]], 1)

    def masks(*key):
        m = draw_masks(ids, completion, position_keep_prob=0.5, prefix_prune_prob=0.5, prefix_min_ratio=0.5,
                       branch_keep_prob=0.5, branch_sampling="paired", drop_common_prefix=False,
                       generator=mask_generator(*key))
        return torch.cat([m.scored.flatten(), m.backprop])

    assert torch.equal(masks(3, 10, 0, 0), masks(3, 10, 0, 0))
    for other in [(4, 10, 0, 0), (3, 11, 0, 0), (3, 10, 1, 0), (3, 10, 0, 1)]:
        assert not torch.equal(masks(3, 10, 0, 0), masks(*other)), other


def test_mask_drawing_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    draw_positions(response_of([20]), 0.5, mask_generator(0, 0, 0, 0))
    assert torch.equal(torch.rand(3), expected)


def test_identity_probabilities_prune_nothing():
    response = response_of([5, 0, 9, 1])
    completion = torch.cat([torch.zeros(4, 1, dtype=torch.long), response.long()], 1)
    ids = torch.randint(5, 50, completion.shape)
    m = draw_masks(ids, completion, position_keep_prob=1.0, prefix_prune_prob=0.0, prefix_min_ratio=0.5,
                   branch_keep_prob=1.0, branch_sampling="paired", drop_common_prefix=False,
                   generator=mask_generator(0, 0, 0, 0))
    assert torch.equal(m.scored, response) and m.backprop.all()
    assert torch.equal(m.weights, response.float())
    assert m.executed.tolist() == [2 + 5 + 1, 0, 2 + 9 + 1, 2 + 1 + 1]  # up to the last response token; 0 if none


def test_common_prefix_marks_the_shared_start_of_both_branches():
    #        prompt | response
    chosen = torch.tensor([[7, 7, 1, 2, 3, 4, 0]])
    rejected = torch.tensor([[7, 7, 1, 2, 9, 4, 5]])
    completion = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]])
    common = common_prefix(torch.cat([chosen, rejected]), completion[:, 1:].bool())
    # shifted column j is input token j + 1: tokens 1, 2 are shared, 3 vs 9 differs
    assert common.long().tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0]]


def test_identical_responses_are_entirely_common():
    ids = torch.tensor([[7, 1, 2], [7, 1, 2]])
    completion = torch.tensor([[0, 1, 1], [0, 1, 1]])
    assert common_prefix(ids, completion[:, 1:].bool()).all()


def test_common_prefix_of_left_padded_pairs_is_found_from_their_real_tokens():
    """A left-padding collator: the pair's rows hold their tokens at different columns; the common prefix is the same
    tokens as right-padded (and a pad that equals the first prompt token does not extend it)."""
    chosen, rejected = [7, 8, 1, 2, 3, 4], [7, 8, 1, 2, 9, 4, 5]  # prompt 7 8 | response
    ids = torch.tensor([[0] + chosen, rejected])
    attention = torch.tensor([[0] + [1] * 6, [1] * 7])
    completion = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])
    left = common_prefix(ids, completion[:, 1:].bool(), attention)
    right = common_prefix(torch.tensor([chosen + [0], rejected]), torch.tensor(
        [[0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]])[:, 1:].bool())
    assert right.long().tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0]]
    assert left.long().tolist() == [[0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]]  # the same tokens, one column later
    ids[0, 0] = 7  # a pad equal to the first prompt token: the run still starts at each row's first real token
    assert torch.equal(common_prefix(ids, completion[:, 1:].bool(), attention), left)
    prompt_differs = torch.tensor([[0, 6, 8, 1, 2, 3, 4], rejected])
    assert not common_prefix(prompt_differs, completion[:, 1:].bool(), attention).any()
