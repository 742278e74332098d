"""The method, pure functions of tensors and ints (no model, no trainer state, no TRL or transformers private):
sampling and inclusion probabilities (masks.py), the estimators (estimators.py), the host plan of a micro-step
(plan.py, from the packed or padded layout of each forward's tokens in packing.py, with the sharing trees of tree.py)
and the arithmetic of "auto" (noise.py).

Flow: token ids -> plan (host: masks, packed layout, weights) -> execute (device: pruned_forward.py) -> estimate ->
TRL's loss. Equations refer to docs/method.md.
"""
