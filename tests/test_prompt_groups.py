"""Prompt groups (issue 37): pairs of a micro-batch that share a prompt run it once, each distinct response once
(method/tree.py), exactly: stock DPOTrainer's loss and gradients for the loss families, checkpointing off and on; the
unshared estimate under the same masks with every pruning; the tokens executed are the arithmetic's; branch pruning
with one response in several pairs stays unbiased; a dropped branch reads its prompt's keys from the grad forward (its
outputs the unpruned ones, its gradient zero, never more tokens than the unpruned forward)."""

import copy
import dataclasses
import os
from itertools import combinations

import pytest
import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from conftest import build_trainer, first_batch
from test_packed import EXACT, assert_exact
from test_share_prompt import (
    PRUNINGS, _host, assert_same_loss_and_grads, assert_shared_estimate_is_unshared, edge_rows, llama, tiny_qwen2,
)
from test_unbiased import max_z
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.method.masks import draw_branches, draw_masks, identical_rows, mask_generator
from trl_pruned_dpo.method.packing import pair_trees, plan_group, prompt_groups, row_trees
from trl_pruned_dpo.method.plan import plan_policy
from trl_pruned_dpo.reference import host_batch
from trl_pruned_dpo.sampler import grouped_order
from trl_pruned_dpo.seam import attention

# (prompt, responses best first): ragged, near-copies (a shared response start), one response a prefix of another,
# a one-token answer; every pair of each ("all pairs") or the best against the rest
GROUPS = [
    ("Q1: add 12+30? ", ["12+30=42", "12+30=43", "42", "it is 42.", "12+30"], "all"),
    ("long prompt " * 3, ["same answer", "same answez", "other", "same"], "all"),
    ("p: ", ["abcdefgh", "abcdefgX", "x"], "best"),
    ("Q4: 7*6? ", ["42", "41"], "all"),  # one pair alone
]


def group_rows(groups=GROUPS):
    rows = []
    for prompt, responses, pairing in groups:
        pairs = combinations(range(len(responses)), 2) if pairing == "all" else [(0, j) for j in
                                                                                range(1, len(responses))]
        rows += [{"prompt": prompt, "chosen": responses[a], "rejected": responses[b]} for a, b in pairs]
    return rows


ROWS = group_rows()
BATCH = len(ROWS)  # 10 + 6 + 2 + 1 pairs, one micro-batch

LOSSES = [  # (model builder, attention, config overrides): the families of tests/test_share_prompt.py
    (llama, "sdpa", {"loss_type": ["sigmoid"]}),
    (llama, "sdpa", {"loss_type": ["sigmoid"], "prune_common_prefix": True}),
    (llama, "sdpa", {"loss_type": ["sppo_hard"]}),
    (llama, "eager", {"loss_type": ["ipo"]}),
    (llama, "sdpa", {"loss_type": ["bco_pair"], "max_length": 40}),  # truncation
    (llama, "sdpa", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "ld_alpha": 0.5}),
    (tiny_qwen2, "sdpa", {"loss_type": ["apo_zero"], "use_weighting": True}),
    (tiny_qwen2, "eager", {"loss_type": ["robust"], "label_smoothing": 0.1, "f_divergence_type": "js_divergence"}),
]


@pytest.mark.parametrize("build, attn, case", LOSSES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_groups_equal_stock(build, attn, case, tokenizer, tmp_path):
    """One micro-batch of 19 pairs in 4 prompt groups: stock's loss (1e-5) and gradients (1e-4 relative),
    checkpointing off and on; the prompt once per group."""
    data = Dataset.from_list(ROWS)
    model = build(tokenizer, attn)
    kw = {"per_device_train_batch_size": BATCH, "max_length": 64, **case}
    stock_kw = {k: v for k, v in kw.items() if k != "prune_common_prefix"}
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, data, tmp_path / "s", model=copy.deepcopy(model),
                          **stock_kw)
    pruned = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / "p",
                           model=copy.deepcopy(model), **kw)
    for checkpointing in (False, True):
        assert_exact(stock, pruned, batch_size=BATCH, checkpointing=checkpointing)
    stats = pruned.last_prune_stats
    assert stats["shared_pairs"] == BATCH
    assert stats["policy_tokens_executed"] * 4 < stats["tokens_needed"]  # 10 pairs of 5 responses run 5 responses


def test_tokens_are_the_arithmetic(tokenizer):
    """Worked by hand (one token per character). Prompt 'wxyz' with responses 'abc', 'abd', 'xy', all three pairs,
    and a lone pair 'pq': 'a'/'bcdef'. The group's rows agree on 'wxyz': positions 0..2 run once; position 3 (which
    predicts 'a' or 'x') once per subtree: 'ab' runs positions 3, 4 once, then 'abc' and 'abd' position 5 each; 'xy'
    runs positions 3, 4. Rows repeated across pairs (the same response) run once."""
    host = _host([("wxyz", "abc", "abd"), ("wxyz", "abc", "xy"), ("wxyz", "abd", "xy"), ("pq", "a", "bcdef")],
                 tokenizer)
    assert prompt_groups(host).tolist() == [0, 0, 0, 3]
    scored = host.completion_mask[:, 1:].bool()
    group = plan_group(host, scored, torch.ones(8, dtype=torch.bool), row_trees(host, True), packed=True)
    # group 0: [0..2] + 'ab' node [3, 5) + 'abc' [5] + 'abd' [5] + 'xy' [3, 5) = 3 + 2 + 1 + 1 + 2 = 9 tokens
    # pair 3 (as a pair today): shared [0] + 'a' [1] + 'bcdef' [1..5] = 1 + 1 + 5 = 7
    assert group.tokens == 9 + 7
    assert torch.equal(group.source >= 0, scored)  # every scored cell routed, nothing else
    # the same batch as pairs: each pair [shared | chosen | rejected]
    pairs = plan_group(host, scored, torch.ones(8, dtype=torch.bool), pair_trees(torch.ones(4, dtype=torch.bool)),
                       packed=True)
    assert pairs.tokens == (5 + 1 + 1) + (3 + 3 + 2) + (3 + 3 + 2) + 7
    # a token's keys are the positions 0 .. its own of its row, read from the tree's nodes
    for row in range(8):
        for col in torch.nonzero(scored[row]).flatten().tolist():
            token = int(group.source[row, col])
            assert int(group.position_ids[0, token]) == col
            assert int(group.input_ids[0, token]) == int(host.input_ids[row, col])
            assert int(group.shift_labels[0, token]) == int(host.input_ids[row, col + 1])
            segment = int(torch.searchsorted(group.cu_seq_q, torch.tensor(token), right=True)) - 1
            keys = group.kv_index[group.cu_seq_k[segment]: group.cu_seq_k[segment + 1]]
            within = token - int(group.cu_seq_q[segment]) + keys.numel() - int(group.cu_seq_q[segment + 1]
                                                                                 - group.cu_seq_q[segment])
            seen = keys[: within + 1]
            assert group.input_ids[0, seen].tolist() == host.input_ids[row, : col + 1].tolist()
            assert group.position_ids[0, seen].tolist() == list(range(col + 1))


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("pruning", PRUNINGS, ids=list(PRUNINGS))
def test_groups_stacked_with_pruning_same_estimate(pruning, checkpointing, tokenizer, tmp_path):
    """Same seed, same masks: the prompt-group execution gives the unshared pruned estimate (loss and gradient)."""
    assert_shared_estimate_is_unshared(ROWS, BATCH, PRUNINGS[pruning], checkpointing, tokenizer, tmp_path)


def test_a_repeated_response_is_one_branch(tokenizer):
    """Rows holding the same tokens (one response in several pairs of a group) get their first row's draw and
    probability; with no repeat the draw is the pairs' own (the masks of a one-pair-per-prompt batch unchanged)."""
    host = _host([("wxyz", "abc", "abd"), ("wxyz", "abc", "xy"), ("pq", "a", "bcdef")], tokenizer)
    assert identical_rows(host.input_ids, host.attention_mask).tolist() == [0, 0, 2, 3, 4, 5]
    probs = torch.tensor([0.5, 0.8, 0.5], dtype=torch.float64)
    for step in range(20):
        masks = draw_masks(host.input_ids, host.completion_mask, position_keep_prob=1.0, prefix_prune_prob=0.0,
                           prefix_min_ratio=0.5, branch_keep_prob=probs, branch_sampling="paired",
                           drop_common_prefix=False, generator=mask_generator(0, step, 0, 0),
                           attention_mask=host.attention_mask)
        assert masks.backprop[1] == masks.backprop[0]
        assert masks.branch_scale[1] == masks.branch_scale[0] == (2.0 if masks.backprop[0] else 0.0)
    lone = _host([("wxyz", "abc", "abd"), ("pq", "a", "bcdef")], tokenizer)
    generator = mask_generator(0, 0, 0, 0)
    expected = draw_branches(2, 0.5, "paired", mask_generator(0, 0, 0, 0))
    masks = draw_masks(lone.input_ids, lone.completion_mask, position_keep_prob=1.0, prefix_prune_prob=0.0,
                       prefix_min_ratio=0.5, branch_keep_prob=0.5, branch_sampling="paired",
                       drop_common_prefix=False, generator=generator, attention_mask=lone.attention_mask)
    assert torch.equal(masks.backprop, expected)


def test_branch_scale_with_repeats_is_unbiased(tokenizer):
    """E[z_b / p] = 1 for every row, repeated responses and per-pair probabilities included (Monte Carlo)."""
    host = _host([("wxyz", "abc", "abd"), ("wxyz", "abc", "xy"), ("wxyz", "xy", "abd"), ("pq", "a", "bcdef")],
                 tokenizer)
    probs = torch.tensor([0.5, 0.75, 0.3, 0.6], dtype=torch.float64)
    for sampling in ("paired", "independent"):
        scales = torch.stack([draw_masks(
            host.input_ids, host.completion_mask, position_keep_prob=1.0, prefix_prune_prob=0.0, prefix_min_ratio=0.5,
            branch_keep_prob=probs, branch_sampling=sampling, drop_common_prefix=False,
            generator=mask_generator(1, step, 0, 0), attention_mask=host.attention_mask).branch_scale.double()
            for step in range(4000)])
        assert max_z(scales, torch.ones(8, dtype=torch.float64)) < 4.5


def test_branch_gradient_with_repeats_is_unbiased(tokenizer, tmp_path):
    """Through the trainer's own forward, prompt groups packed: the mean gradient over many branch draws is the exact
    one (the 300 largest coordinates within 5 standard errors)."""
    from test_unbiased import gradient_z

    rows = group_rows([GROUPS[0][:2] + ("best",), GROUPS[2]])  # 4 + 2 pairs; 'best': one chosen in 4 pairs
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(rows), tmp_path,
                            per_device_train_batch_size=len(rows), branch_keep_prob=0.5)
    batch = first_batch(trainer, len(rows))
    assert gradient_z(trainer, batch, 300) < 5.0
    assert trainer.last_prune_stats["shared_pairs"] + trainer.last_prune_stats["split_pairs"] == len(rows)


FROZEN_CASES = {  # (rows, micro-batch, config): pairs, prompt groups, the common prefix, prefix pruning (rows cut)
    "pairs": (edge_rows, 8, {}),
    "groups": (group_rows, BATCH, {}),
    "groups-common-prefix": (group_rows, BATCH, dict(prune_common_prefix=True)),
    "groups-prefix-pruning": (group_rows, BATCH, dict(prefix_prune_prob=1.0, prefix_min_ratio=0.2)),
}
CHECKPOINTING = {"off": None, "non-reentrant": {"use_reentrant": False}, "reentrant": {"use_reentrant": True}}


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("case", FROZEN_CASES)
def test_frozen_rows_read_the_grad_forwards_keys(case, checkpointing, tokenizer, tmp_path, monkeypatch):
    """Branch pruning, packed: pairs, prompt groups, the common prefix, prefix pruning; checkpointing off, non-reentrant
    and reentrant (its first forward runs under no_grad)."""
    rows, batch, config = FROZEN_CASES[case]
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(rows()), tmp_path,
                            per_device_train_batch_size=batch, max_length=64, branch_keep_prob=0.5, **config)
    assert_frozen_rows_read_the_kept_keys(trainer, batch, CHECKPOINTING[checkpointing], monkeypatch)


@pytest.mark.parametrize("build", EXACT, ids=lambda b: b.__name__)
def test_frozen_rows_read_the_kept_keys_in_every_family(build, tokenizer, tmp_path, monkeypatch):
    """The families of test_packed.py (QK-norm, partial rotary, sliding windows, soft-capping, learned positions): the
    keys kept are what each attention receives, after its own position encoding and norms."""
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows()), tmp_path,
                            model=build(tokenizer), per_device_train_batch_size=8, max_length=48, branch_keep_prob=0.5)
    assert trainer.forward_choice.packed and trainer.forward_choice.share_prompt
    assert_frozen_rows_read_the_kept_keys(trainer, 8, CHECKPOINTING["non-reentrant"], monkeypatch)


def assert_frozen_rows_read_the_kept_keys(trainer, batch, checkpointing, monkeypatch):
    """Under one draw of the masks: every per-token output, the frozen rows' included, is the unpruned forward's
    (every row with grad, each prompt group one tree) to round-off, in as many tokens; the frozen rows' log-probs
    have a zero gradient; the grad forward keeps the keys of each attention call once (checkpointing's replay in the
    backward keeps none) and the frozen forward reads them all."""
    if checkpointing is None:
        trainer.model.gradient_checkpointing_disable()
    else:
        trainer.model.gradient_checkpointing_enable(checkpointing)
    inputs = first_batch(trainer, batch)
    masks = trainer.draw_masks(host_batch(inputs), trainer.args.mask_options(), mask_generator(0, 0, 0, 0))
    kept, read = [], []
    keep, prepend = attention.SharedKeys.keep, attention.SharedKeys.prepend
    monkeypatch.setattr(attention.SharedKeys, "keep", lambda self, *a: (kept.append(self.keeping), keep(self, *a))[1])
    monkeypatch.setattr(attention.SharedKeys, "prepend", lambda self, *a: (read.append(1), prepend(self, *a))[1])
    monkeypatch.setattr(trainer, "draw_masks", lambda *args: masks)
    pruned = trainer.concatenated_forward(trainer.model, inputs).per_token
    tokens = trainer.last_prune_stats["policy_tokens_executed"]
    calls = len(kept)
    assert calls >= trainer.model.config.num_hidden_layers and all(kept) and len(read) == calls

    trainer.model.zero_grad(set_to_none=True)
    frozen = ~masks.backprop
    assert frozen.any() and masks.backprop.any()
    pruned["log_probs"][frozen].sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())
    assert not any(kept[calls:]) and (len(kept) > calls) == (checkpointing is not None)  # the replay kept nothing

    every = dataclasses.replace(masks, backprop=torch.ones_like(masks.backprop),
                                branch_scale=torch.ones_like(masks.branch_scale))
    monkeypatch.setattr(trainer, "draw_masks", lambda *args: every)
    trainer.args.branch_keep_prob = 1.0
    with torch.no_grad():
        full = trainer.concatenated_forward(trainer.model, inputs).per_token
    for field in ("log_probs", "entropy", "mean_logits"):
        torch.testing.assert_close(pruned[field].detach(), full[field], rtol=1e-5, atol=1e-5, msg=field)
    assert torch.equal(pruned["is_top1"], full["is_top1"])
    assert tokens == trainer.last_prune_stats["policy_tokens_executed"]


@pytest.mark.parametrize("seed", range(4))
def test_branch_pruning_runs_no_more_tokens_than_exact(seed):
    """Random prompt groups (responses sharing starts, repeating, ending inside each other) and random draws (branch
    0.5 paired and independent, 0.3 and 0.8; prefix and position pruning; the common prefix), shared and padding-free:
    the two policy groups run exactly the unpruned forward's tokens. Only a draw that leaves one group nothing to run
    (every response backpropagated, or none, or the frozen ones inside the kept ones) costs two tokens more: the empty
    group still runs two, as every process runs the same modules."""
    from benchmarks.host_plan import host_batch

    g = torch.Generator().manual_seed(seed)
    draws = dict(same=0, empty=0)
    for batch in range(6):
        rows = []
        for group in range(int(torch.randint(1, 5, (1,), generator=g))):
            prompt = torch.randint(3, 6, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
            answers = [torch.randint(3, 6, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                       for _ in range(int(torch.randint(2, 5, (1,), generator=g)))]
            rows += [(prompt, answers[a], answers[b]) for a, b in combinations(range(len(answers)), 2)]
        host = host_batch(rows)
        for step, (p, sampling, prefix, position) in enumerate(
                [(0.5, "paired", 0.0, 1.0), (0.5, "independent", 0.0, 1.0), (0.3, "paired", 0.7, 1.0),
                 (0.8, "independent", 0.5, 0.6), (0.5, "paired", 1.0, 0.5)]):
            masks = draw_masks(host.input_ids, host.completion_mask, position_keep_prob=position,
                               prefix_prune_prob=prefix, prefix_min_ratio=0.3, branch_keep_prob=p,
                               branch_sampling=sampling, drop_common_prefix=bool(step % 2),
                               generator=mask_generator(seed, batch, step, 0), attention_mask=host.attention_mask)
            every = dataclasses.replace(masks, backprop=torch.ones_like(masks.backprop))
            for share in (True, False):
                exact = plan_policy(host, every, frozen_group=False, share=share, packed=True).grad.tokens
                plan = plan_policy(host, masks, frozen_group=True, share=share, packed=True)
                empty = min(plan.grad.scored, plan.frozen.scored) == 0  # a group with no node: its two tokens
                assert plan.grad.tokens + plan.frozen.tokens == exact + (2 if empty else 0)
                assert share or (plan.frozen.reads == 0 and plan.grad.keeps is None)  # rows alone share nothing
                draws["empty" if empty else "same"] += 1
    assert draws["same"] > 3 * draws["empty"]


def test_a_lone_pair_plans_as_before(tokenizer):
    """One pair per prompt: the prompt-group trees are the pair trees (the same packed row, token for token)."""
    host = _host([("wxyz", "abc", "abd"), ("wxy", "xy", "xy"), ("pq", "a", "bcdef")], tokenizer)
    scored = host.completion_mask[:, 1:].bool()
    run = torch.ones(6, dtype=torch.bool)
    grouped = plan_group(host, scored, run, row_trees(host, True), packed=True)
    paired = plan_group(host, scored, run, pair_trees(torch.ones(3, dtype=torch.bool)), packed=True)
    for name in ("input_ids", "position_ids", "shift_labels", "cu_seq_q", "cu_seq_k", "kv_index", "source"):
        assert torch.equal(getattr(grouped, name), getattr(paired, name)), name


# ---------------------------------------------------------------------------------- the sampler (group_by_prompt)
def test_grouped_order_keeps_groups_whole_where_they_fit():
    sizes = [1, 2, 3, 4, 6, 2, 1, 5, 3, 3, 9]  # one group larger than a batch
    groups, start = [], 0
    for n in sizes:
        groups.append(list(range(start, start + n)))
        start += n
    batch = 6
    orders = [grouped_order(groups, batch, torch.Generator().manual_seed(seed)) for seed in (0, 0, 1)]
    assert orders[0] == orders[1] and orders[0] != orders[2]  # a function of the seed
    for order in orders:
        assert sorted(order) == list(range(start))  # every pair once
        batches = [order[i: i + batch] for i in range(0, len(order), batch)]
        where = {i: b for b, chunk in enumerate(batches) for i in chunk}
        split = [g for g in groups if len({where[i] for i in g}) > 1]
        # at most the large group (two batches at least) and the batches' last remainders are split
        assert groups[-1] in split and len(split) <= 3, split
        for g in groups:  # a group's pairs stay in dataset order
            assert [i for i in order if i in g] == g


def test_group_by_prompt_batches_resume_and_ranks(tokenizer, tmp_path):
    """The trainer's dataloader: each micro-batch holds whole prompt groups (here every group fits), the order is the
    same for every process (it depends on the seed and epoch only), another epoch reorders, and skipping batches as
    a resume does continues the same order."""
    from accelerate import skip_first_batches

    rows = group_rows()
    shuffled = [rows[i] for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()]
    data = Dataset.from_list(shuffled)

    def batches(trainer, epoch, skip=0):
        loader = trainer.get_train_dataloader()
        if skip:
            loader = skip_first_batches(loader, skip)
        loader.set_epoch(epoch)
        return [tuple(tuple(ids) for ids in batch["input_ids"].tolist()) for batch in loader]

    trainers = [build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / f"r{rank}",
                              per_device_train_batch_size=10, group_by_prompt=True) for rank in range(2)]
    first = batches(trainers[0], 0)
    assert first == batches(trainers[1], 0) and first != batches(trainers[0], 1)
    assert batches(trainers[0], 0, skip=1) == first[1:]
    loader = trainers[0].get_train_dataloader()
    loader.set_epoch(0)
    seen = []  # the 4 groups (10, 6, 2, 1 pairs) in batches of 10: each group in one batch
    for batch in loader:
        host = batch["host_batch"]
        prompt = (host.attention_mask.bool() & ~host.completion_mask.bool()).chunk(2)[0]
        keys = {tuple(ids[keep].tolist()) for ids, keep in zip(host.input_ids.chunk(2)[0], prompt)}
        assert not keys & set(seen)
        seen += keys
    assert len(seen) == 4
    off = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / "off",
                        per_device_train_batch_size=10)
    assert type(off._get_train_sampler()).__name__ != "PromptGroupSampler"


def test_group_by_prompt_is_refused_with_another_sampling_strategy(tmp_path):
    with pytest.raises(ValueError, match="group_by_prompt"):
        PrunedDPOConfig(output_dir=str(tmp_path), group_by_prompt=True, train_sampling_strategy="group_by_length",
                        bf16=False)


@pytest.mark.parametrize("seed", range(6))
def test_random_forests_against_a_naive_count(seed):
    """Random prompt groups over a 3-token alphabet (so responses share starts, repeat, and end inside each other),
    random scored masks (prefix and position pruning shapes): the packed row runs each (prompt group, tokens 0..p+1)
    exactly once (the naive count: a set of tuples), and every scored cell sees exactly its row's tokens 0..p at
    positions 0..p, and is labelled with its next token."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for group in range(int(torch.randint(2, 6, (1,), generator=g))):
        prompt = torch.randint(3, 6, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
        answers = [torch.randint(3, 6, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(int(torch.randint(1, 5, (1,), generator=g)))]
        rows += [(prompt, answers[a], answers[b]) for a, b in combinations(range(len(answers)), 2)] or [
            (prompt, answers[0], answers[0])]
    from benchmarks.host_plan import host_batch

    host = host_batch(rows)
    response = host.completion_mask[:, 1:].bool()
    scored = response & (torch.rand(response.shape, generator=g) < 0.7)
    run = torch.rand(response.size(0), generator=g) < 0.9
    trees = row_trees(host, True)
    group = plan_group(host, scored, run, trees, packed=True)
    ids = host.input_ids
    need = (scored.long() * torch.arange(1, scored.size(1) + 1)).amax(dim=1)
    expected = {(int(trees[r]), tuple(ids[r, : p + 2].tolist())) for r in range(len(ids)) if run[r]
                for p in range(int(need[r]))}
    if expected:
        assert group.tokens == len(expected)
    for r, c in torch.nonzero(scored & run[:, None]).tolist():
        token = int(group.source[r, c])
        segment = int(torch.searchsorted(group.cu_seq_q, torch.tensor(token), right=True)) - 1
        q0, q1 = int(group.cu_seq_q[segment]), int(group.cu_seq_q[segment + 1])
        keys = group.kv_index[group.cu_seq_k[segment]: group.cu_seq_k[segment + 1]]
        seen = keys[: token - q0 + keys.numel() - (q1 - q0) + 1]
        assert group.input_ids[0, seen].tolist() == ids[r, : c + 1].tolist()
        assert group.position_ids[0, seen].tolist() == list(range(c + 1))
        assert int(group.shift_labels[0, token]) == int(ids[r, c + 1])
    assert int((group.source >= 0).sum()) == int((scored & run[:, None]).sum())


def test_the_ranked_real_text_task():
    """builtin:python-docs-ranked: per prompt 4 graded answers and all 6 pairs, together; held-out prompts unseen."""
    from trl_pruned_dpo.demo.tasks import builtin_names, load_builtin

    assert "builtin:python-docs-ranked" in builtin_names()
    splits = load_builtin("builtin:python-docs-ranked")
    for split in splits.values():
        assert len(split) % 6 == 0 and len(split) >= 60
        for start in range(0, len(split), 6):
            group = split[start: start + 6]
            assert len({str(p) for p in group["prompt"]}) == 1
            answers = [group["chosen"][0][0]["content"]] + [r[0]["content"] for r in group["rejected"][:3]]
            assert len(set(answers)) == 4  # best first: pairs (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
            assert [c[0]["content"] for c in group["chosen"]] == [answers[i] for i in (0, 0, 0, 1, 1, 2)]
            assert len(os.path.commonprefix(answers[:3])) >= 20  # near-copies: the opening sentence kept
    train_prompts = {str(p) for p in splits["train"]["prompt"]}
    assert not train_prompts & {str(p) for p in splits["test"]["prompt"]}


def test_the_benchmarks_run(tmp_path):
    """Smoke: the prompt-group step-time harness (k = 3, both pairings, tiny lengths, one round) and the host-plan
    harness write their tables; prompt groups run the arithmetic's tokens and stock's first loss."""
    import json

    from benchmarks import host_plan, prompt_groups

    prompt_groups.main(["--k", "3", "--scale", "0.0625", "--rounds", "1", "--warmup", "0", "--batches", "1",
                        "--pairs", "2", "--out", str(tmp_path / "pg")])
    rows = json.loads((tmp_path / "pg" / "prompt_groups.json").read_text())["rows"]
    assert [(r["k"], r["pairing"]) for r in rows] == [(3, "best"), (3, "all")]
    for r in rows:
        assert 0.9 <= r["groups_over_arithmetic"] <= 1.0 and r["groups_tokens"] < r["pairs_tokens"]
        assert abs(r["groups_first_loss"] - r["stock_first_loss"]) < 1e-4
    host_plan.main(["--repeats", "1", "--out", str(tmp_path / "hp")])
    assert len(json.loads((tmp_path / "hp" / "host_plan.json").read_text())["rows"]) == 6
