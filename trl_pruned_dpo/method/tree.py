"""Sharing trees: the packed layout of rows that may share their leading tokens (docs/method.md, "Prompt groups").

The rows of one tree (the two rows of a pair, or every row of a prompt group: all pairs with the same prompt) run as
the radix tree of their token sequences. A node runs, once, the positions where all its rows hold the same tokens
(same context) and predict the same next token; each distinct sequence runs the rest of itself once. A pair is the
tree [shared | chosen | rejected]; a prompt group with k distinct responses is [prompt | response 1 | .. | response k]
(deeper where responses share a start); identical responses are one leaf. Each node is one segment of the packed
row, keyed on its ancestors' tokens then itself (lower-right causal, attention.py), its positions continuing theirs.

Built from one lexicographic sort of the rows (`torch.unique(dim=0)`: identical rows merge) and the longest common
prefix of neighbours in that order: the tree of a sorted range is split where that prefix is shortest (the
LCP-interval tree). Python runs once per node (a few per row), tensors do everything per token.
"""

from dataclasses import dataclass

import torch

_WIDE = 1 << 32  # a key (record, position) as record * _WIDE + position, for one searchsorted


@dataclass
class Forest:
    """The nodes of every tree, in packed order (each tree's nodes in preorder, trees by id), empty ones dropped.

    start, end: (nodes,) the positions [start, end) a node runs; reader: (nodes,) a row whose tokens it reads; first:
    (nodes,) where its tokens start in the packed row; tree: (nodes,) its tree id. `row_key`, `row_node`: for each
    distinct sequence, the nodes on its path (root first) as searchsorted records keyed sequence * _WIDE + start.
    `seg_key`, `seg_node`: the same for each node's keys (its ancestors, then itself); `distinct`: (rows,) the record
    owner of each row (its distinct sequence; -1 for rows not running)."""

    start: torch.Tensor
    end: torch.Tensor
    reader: torch.Tensor
    first: torch.Tensor
    tree: torch.Tensor
    row_key: torch.Tensor
    row_node: torch.Tensor
    seg_key: torch.Tensor
    seg_node: torch.Tensor
    distinct: torch.Tensor

    @property
    def tokens(self) -> int:
        return int((self.end - self.start).sum())


def _sorted_rows(ids: torch.Tensor, length: torch.Tensor, trees: torch.Tensor, rows: torch.Tensor):
    """(lens, lcp, inverse, reader) of the distinct sequences [tree id, tokens..] of `rows`, in lexicographic order:
    lens their token counts, lcp[i] the common leading tokens of sequences i - 1 and i (-1: other trees), inverse the
    sequence of each of `rows`, reader a row holding each sequence."""
    width = int(length[rows].max())
    cols = torch.arange(width)
    tokens = torch.where(cols < length[rows, None], ids[rows, :width], -1)  # -1 sorts a prefix before its extensions
    unique, inverse = torch.unique(torch.cat([trees[rows, None], tokens], dim=1), dim=0, return_inverse=True)
    same = (unique[1:] == unique[:-1]).long().cumprod(dim=1).sum(dim=1) - 1
    reader = torch.full((unique.size(0),), rows.numel(), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(rows.numel()), "amin")
    return (unique[:, 1:] >= 0).sum(dim=1).tolist(), [0, *same.tolist()], inverse, rows[reader]


def build_forest(ids: torch.Tensor, length: torch.Tensor, trees: torch.Tensor) -> Forest | None:
    """The forest of the rows with `length` > 1: row r's sequence is ids[r, :length[r]] (the positions it runs, then
    the token its last one predicts), rows of equal `trees` id share. ids: (rows, cols) real tokens from column 0.
    None when no row runs."""
    rows = torch.nonzero(length > 1).flatten()
    if not rows.numel():
        return None
    lens, lcp, inverse, reader = _sorted_rows(ids, length, trees, rows)
    start, end, read, parent, leaf = [], [], [], [], [0] * len(lens)

    def grow(lo, hi, begin, up):
        """The node of sorted range [lo, hi), running from position `begin`, under node `up`; then its children."""
        common = lens[lo] if hi - lo == 1 else min(lcp[lo + 1: hi])
        node = len(start)
        start.append(begin), end.append(max(begin, common - 1)), read.append(lo), parent.append(up)
        if hi - lo == 1:
            leaf[lo] = node
            return
        # position common - 1 predicts a different token in each child: each runs it (the pair's s - 1, method.md)
        cuts = [lo] + [i for i in range(lo + 1, hi) if lcp[i] == common] + [hi]
        for a, b in zip(cuts[:-1], cuts[1:]):
            grow(a, b, max(common - 1, 0), node)

    cuts = [0] + [i for i in range(1, len(lens)) if lcp[i] < 0] + [len(lens)]
    for a, b in zip(cuts[:-1], cuts[1:]):  # one tree per id
        grow(a, b, 0, -1)

    # drop empty nodes (a pair's identical rows: one node; a row ending where its parent does), packed in preorder
    keep = [e > s for s, e in zip(start, end)]
    index, first, total = [-1] * len(start), [], 0
    for n, k in enumerate(keep):
        if k:
            index[n] = len(first)
            first.append(total)
            total += end[n] - start[n]

    def chain(n):  # the non-empty nodes from the root down to n, as packed indices
        out = []
        while n >= 0:
            if keep[n]:
                out.append(index[n])
            n = parent[n]
        return out[::-1]

    row_chains = [chain(leaf[d]) for d in range(len(lens))]
    seg_chains = [chain(n) for n in range(len(start)) if keep[n]]
    kept = torch.tensor(keep)
    start_t, end_t = torch.tensor(start)[kept], torch.tensor(end)[kept]
    reader_t = reader[torch.tensor(read)[kept]]

    def records(chains):
        owner = torch.repeat_interleave(torch.arange(len(chains)), torch.tensor([len(c) for c in chains]))
        node = torch.tensor([n for c in chains for n in c], dtype=torch.long)
        return owner * _WIDE + start_t[node], node

    distinct = torch.full((ids.size(0),), -1, dtype=torch.long)
    distinct[rows] = inverse
    return Forest(start_t, end_t, reader_t, torch.tensor(first, dtype=torch.long), trees[reader_t],
                  *records(row_chains), *records(seg_chains), distinct)


def locate(key: torch.Tensor, node: torch.Tensor, owner: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The node of each (owner, position): the last record of `owner` starting at or before `position`."""
    return node[torch.searchsorted(key, owner * _WIDE + position, right=True) - 1]


def tree_tokens(forest: Forest | None, trees: int) -> torch.Tensor:
    """(trees,) tokens each tree id runs."""
    out = torch.zeros(trees, dtype=torch.long)
    if forest is not None:
        out.index_add_(0, forest.tree, forest.end - forest.start)
    return out
