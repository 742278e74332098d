"""The quality study: stock TRL `DPOTrainer` against `PrunedDPOTrainer` settings on tasks with a ground truth.

Run it with ``python -m evaluation.quality`` (``--quick`` for the CI-sized version); docs/quality.md holds the
results and the command that produced them. Modules, in the order a run uses them:

- tasks.py      the study's preference data (demo tasks, responses from 2 to ~250 tokens), splits that never overlap
- sft.py        the warm-started starting policy (a short SFT of the demo's tiny model), cached on disk
- settings.py   the named trainer settings compared, stock first
- prototypes.py estimator variants not (yet) in the trainer: pair-shared position masks, keep-probability annealing
- train.py      one (setting, seed) run: DPO from the starting policy, exact held-out evaluation every few steps
- evaluate.py   the exact (unpruned) held-out metrics: implicit-reward accuracy and margin, greedy generation accuracy
- gradients.py  pruned-vs-full gradient diagnostics on fixed batches (cosine, relative variance, bias)
- report.py     aggregation over seeds (t-intervals), the PNG curves and the markdown tables
- quality.py    the command line that runs all of the above, resumable
"""
