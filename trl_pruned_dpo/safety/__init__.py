"""Run-safety: what keeps a run trustworthy when it fails, is stopped or is resumed. Never imports the trainer.

- checkpoints.py: a completion marker written last; resume only from a complete checkpoint with this run's pruning.
- disk_writes.py: files flushed and written atomically, with their siblings' modes; a full disk told from other errors.
- guards.py: settings that should alarm, before training; a diverging run stopped before it is checkpointed.
- data_checks.py: degenerate and truncated pairs, said before training.
- output_dir.py: one run per output folder, a folder that can be written, checked before any work.
- signals.py: SIGTERM/Ctrl-C stop at the end of a step with a checkpoint, and the command that resumes.
- run_state.py: the trainer's safety fields in one object (`trainer.run_state`).
"""
