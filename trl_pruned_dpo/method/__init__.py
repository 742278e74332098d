"""The method, with no trainer state and no TRL private: sampling and inclusion probabilities (masks.py), the
estimators (estimators.py), the host plan of a micro-step's forwards (plan.py) and its device execution (execute.py).

Flow: token ids -> plan (host: masks, packed layout, weights) -> execute (device) -> estimate -> TRL's loss.
Equations refer to docs/method.md.
"""
