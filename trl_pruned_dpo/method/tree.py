"""Sharing trees: the packed layout of rows that may share their leading tokens (docs/prompt_groups.md).

The rows of one tree (the two rows of a pair, or every row of a prompt group: all pairs with the same prompt) run as
the radix tree of their token sequences. A node runs, once, the positions where all its rows hold the same tokens
(same context) and predict the same next token; each distinct sequence runs the rest of itself once. A pair is the
tree [shared | chosen | rejected]; a prompt group with k distinct responses is [prompt | response 1 | .. | response k]
(deeper where responses share a start); identical responses are one leaf. Each node is one segment of the packed
row, keyed on its ancestors' tokens then itself (lower-right causal, attention.py), its positions continuing theirs.

Built from one lexicographic sort of the rows (`torch.unique(dim=0)`: identical rows merge) and the longest common
prefix of neighbours in that order (the LCP-interval tree), vectorised: no Python loop per node or token.
"""

from dataclasses import dataclass

import torch

_WIDE = 1 << 32  # a key (record, position) as record * _WIDE + position, for one searchsorted


@dataclass
class Forest:
    """The nodes of every tree, in packed order (each tree's nodes in preorder, trees by id), empty ones dropped.

    start, end: (nodes,) the positions [start, end) a node runs; reader: (nodes,) a row whose tokens it reads; tree:
    (nodes,) its tree id. `row_key`, `row_node`: for each distinct sequence, the nodes on its path (root first) as
    searchsorted records keyed sequence * _WIDE + start. `key_owner`, `key_nodes`: records node by node (`key_owner`
    ascending) of the nodes whose tokens are its keys (its ancestors, root first, then itself): positions 0 .. end - 1
    of its rows; `distinct`: (rows,) the record owner of each row (its distinct sequence; -1 for rows not running).
    A group may run some nodes only (branch pruning, packing.py): it lays them out in this order."""

    start: torch.Tensor
    end: torch.Tensor
    reader: torch.Tensor
    tree: torch.Tensor
    row_key: torch.Tensor
    row_node: torch.Tensor
    key_owner: torch.Tensor
    key_nodes: torch.Tensor
    distinct: torch.Tensor

    def path_nodes(self, sequences: torch.Tensor) -> torch.Tensor:
        """(nodes,) bool: the nodes on the paths of the distinct `sequences` (ids of `distinct`)."""
        on = torch.zeros(self.start.numel(), dtype=torch.bool)
        on[self.row_node[torch.isin(self.row_key // _WIDE, sequences)]] = True
        return on


def build_forest(ids: torch.Tensor, length: torch.Tensor, trees: torch.Tensor) -> Forest | None:
    """The forest of the rows with `length` > 1: row r's sequence is ids[r, :length[r]] (the positions it runs, then
    the token its last one predicts), rows of equal `trees` id share. ids: (rows, cols) real tokens from column 0.
    None when no row runs.

    Sorted, a tree's distinct sequences are its leaves left to right, and every inner node is a run of neighbours
    whose common prefix is at least its depth: the boundary between sequences i - 1 and i, with common prefix h[i],
    belongs to the node of depth h[i] spanning from the previous boundary below h[i] to the next one. A node runs the
    positions [parent depth - 1, its depth - 1) (a leaf: to its length - 1): position depth - 1 predicts a different
    token in each child, so each child runs it (the pair's s - 1, docs/method.md). Everything is a (sequences x
    sequences) comparison: no Python per node."""
    rows = torch.nonzero(length > 1).flatten()
    if not rows.numel():
        return None
    width = int(length[rows].max())
    tokens = torch.where(torch.arange(width) < length[rows, None], ids[rows, :width], -1)  # -1: a prefix sorts first
    unique, inverse = torch.unique(torch.cat([trees[rows, None], tokens], dim=1), dim=0, return_inverse=True)
    u = unique.size(0)
    lens = (unique[:, 1:] >= 0).sum(dim=1)
    edge = torch.full((1,), -1, dtype=torch.long)  # another tree (or none) beyond either end
    h = torch.cat([edge, (unique[1:] == unique[:-1]).long().cumprod(dim=1).sum(dim=1) - 1, edge])  # (u + 1,)

    # inner nodes: per boundary b (1 .. u-1, same tree), the nearest boundaries on each side with a smaller prefix
    b = torch.arange(1, u)
    index = torch.arange(u + 1)
    smaller = h[None, :] < h[b, None]
    left = torch.where(smaller & (index[None, :] < b[:, None]), index, -1).amax(dim=1)
    right = torch.where(smaller & (index[None, :] > b[:, None]), index, u + 1).amin(dim=1)
    inner = h[b] >= 0
    # one node per run: (first sequence, last + 1, depth = the common prefix of its boundaries)
    span = torch.unique(torch.stack([left[inner], right[inner], h[b][inner]], dim=1), dim=0)
    leaf = torch.arange(u)
    lo = torch.cat([leaf, span[:, 0]])  # sequences lo .. hi - 1
    hi = torch.cat([leaf + 1, span[:, 1]])
    own = torch.cat([lens, span[:, 2]])
    parent = h[lo].maximum(h[hi])  # the depth of the node above: the larger prefix at either edge
    start = (parent - 1).clamp(min=0)
    end = start.maximum(own - 1)

    # preorder (a node before the nodes inside it, left to right), empty nodes dropped
    order = torch.argsort(lo * (u + 2) + (u + 1 - hi))
    order = order[(end > start)[order]]
    lo, hi, start, end = lo[order], hi[order], start[order], end[order]
    reader = rows[torch.zeros(u, dtype=torch.long).scatter_reduce(0, inverse, torch.arange(rows.numel()), "amax",
                                                                  include_self=False)]

    def records(owner_lo, owner_hi):
        """(keys, nodes) of each owner's nodes (the nodes whose span holds the owner's), sorted by owner then start."""
        holds = (lo[None, :] <= owner_lo[:, None]) & (hi[None, :] >= owner_hi[:, None])
        owner, node = torch.nonzero(holds, as_tuple=True)
        key = owner * _WIDE + start[node]
        key, sort = torch.sort(key)
        return key, node[sort]

    distinct = torch.full((ids.size(0),), -1, dtype=torch.long)
    distinct[rows] = inverse
    key, key_nodes = records(lo, hi)
    return Forest(start, end, reader[lo], trees[reader[lo]], *records(leaf, leaf + 1), key // _WIDE, key_nodes,
                  distinct)


def locate(key: torch.Tensor, node: torch.Tensor, owner: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The node of each (owner, position): the last record of `owner` starting at or before `position`."""
    return node[torch.searchsorted(key, owner * _WIDE + position, right=True) - 1]
