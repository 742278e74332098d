"""The quality study: stock TRL `DPOTrainer` against `PrunedDPOTrainer` settings on tasks with a ground truth.

Run it with ``python -m evaluation.quality`` (``--quick`` for the CI-sized version); docs/quality.md holds the
results and the command that produced them. Modules, in the order a run uses them:

- tasks.py      the study's preference data (sort from the demo, count; responses of 2 to ~240 tokens), splits
                that never overlap
- sft.py        the warm-started starting policy (a short SFT of the demo's tiny model), cached on disk
- settings.py   the named trainer settings compared, stock first
- prototypes.py mask laws fixed outside the trainer (per pair, per row), balanced branch sampling, annealing
- train.py      one (setting, seed) run: DPO from the starting policy, exact held-out evaluation every few steps
- evaluate.py   the exact (unpruned) held-out metrics: implicit-reward accuracy and margin, greedy generation accuracy
- gradients.py  pruned-vs-full gradient diagnostics on fixed batches (cosine, relative variance, bias)
- report.py     aggregation over seeds (t-intervals, paired deltas, equal-time readings) and the PNG plots
- write_doc.py  the main study's section of docs/quality.md from the cached results (the page's hand-written parts
                stay)
- quality.py    the command line that runs all of the above, resumable
- store.py      the result store it resumes from (JSON keyed by a fingerprint), shared with regimes.py

The regimes study (data x batch size; regimes.py, regimes_report.py) and three tools on `auto` (auto_overhead.py:
its cost where it keeps everything; auto_trace.py: its choices over a long run; auto_rows.py: its rows of a regimes
folder against the exact run) are documented in docs/quality.md; tests/test_quality_quick.py runs each at tiny sizes.
"""
