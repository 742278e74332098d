"""The regimes study: data regime x batch size x setting x seed, and what explains the results.

``python -m evaluation.regimes --jobs J`` (resumable; ``--stage train|gradients|timing|report``; run the timing stage
alone on the machine). Beside the main study (quality.py: near-copy pairs, 8 pairs per step), it asks where the extra
estimator noise of pruning is cheap:

- regimes: ``near`` (the main study's near-copy pairs) and ``dissimilar`` (tasks.dissimilar_pairs: two different
  answers that differ from the first response token on); also ``dissimilar-clean`` and ``reversed`` (tasks.py),
  the cells of issue 21's `auto` rows, with ``--lr-scale`` to scale every learning rate;
- batch sizes 8, 32 and 64 pairs per step, at the *same number of steps* (STEPS; so B = 64 sees 8 times the pairs
  of B = 8: the question is what pruning's extra noise costs a run of a given batch size, and a run of 4 large steps
  says nothing), the learning rate scaled by the square-root rule for Adam (lr = 1e-4 * sqrt(B / 8); Malladi et al.
  2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms") and the warmup kept at 80 pairs;
- per regime, at the starting policy with batches of 8 pairs: stock's simple noise scale B_simple = tr(Σ) / |G|²
  (McCandlish et al. 2018) and each setting's extra-noise ratio r (gradients.diagnose, "noise / SGD noise"), so that
  each cell can be checked against the 1 + B_simple (1 + r) / B model.

Runs are grouped one process per (regime, seed) so the imports are paid once per group, not per run.
Results: ``<out>/<regime>-b<B>/runs/<setting>-s<seed>.json`` (one file per run, reused when its fingerprint matches),
``<out>/gradients-<regime>.json``, ``<out>/timing-<regime>-b<B>.json``; the report is the "Regimes" section of
docs/quality.md (``--docs``).
"""

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from . import store  # the result store quality.py uses too
from .store import REPO

REGIME_NAMES = ("near", "dissimilar", "dissimilar-clean", "reversed")
BATCHES = (8, 32, 64)
SETTINGS = ("stock", "branch_cp", "position_cp", "prefix_cp", "combined_cp", "auto_cp", "auto_share_cp")
DIAGNOSED = ("branch_cp", "position_cp", "prefix_cp", "combined_cp", "auto_cp")
SEEDS = (0, 1, 2, 3, 4)
STEPS = 24  # the equal-steps budget N, every batch size (B = 64 sees 1536 pairs by N, 3/4 of the training split)
N_TRAIN, N_TEST, N_SFT, SFT_STEPS = 2048, 128, 16384, 1000  # the main study's starting policy and splits
N_HELD_OUT = 128  # held-out pairs evaluated (all the test pairs)
BASE_LR, BASE_BATCH, WARMUP_PAIRS = 1e-4, 8, 80
EVALS = 6  # evaluations up to the equal-steps budget (+ 3 beyond it)
TIMING_ROUNDS, TIMING_STEPS = 5, 2  # round-robin step timing per cell: the median over rounds of each ratio to stock


def run_config(batch: int, steps: int = STEPS, lr_scale: float = 1.0):
    from .train import RunConfig

    return RunConfig(steps=steps, pruned_steps_factor=1.5, batch_size=batch,
                     learning_rate=lr_scale * BASE_LR * math.sqrt(batch / BASE_BATCH),
                     warmup=max(1, round(WARMUP_PAIRS / batch)), eval_every=max(1, steps // EVALS),
                     gen_every=10**9, eval_batch_size=64, generate=False)


class Regimes:
    # The design the report reads back from the study (regimes_report.py is below this module and never imports it).
    diagnosed, timing_rounds = DIAGNOSED, TIMING_ROUNDS

    def __init__(self, out: Path, steps: int = STEPS, n_test: int = N_TEST, quick: bool = False, lr_scale: float = 1.0):
        from .sft import SFTSpec

        self.out, self.steps, self.n_test, self.quick, self.lr_scale = out, steps, n_test, quick, lr_scale
        self._data_keys = {}
        if quick:
            self.sft = SFTSpec(quick=True, n_examples=256, steps=10, n_train=64, n_test=n_test)
            self.n_train = 64
        else:
            self.sft = SFTSpec(n_examples=N_SFT, steps=SFT_STEPS, n_train=N_TRAIN, n_test=N_TEST)
            self.n_train = N_TRAIN

    def policy(self) -> str:
        from .sft import starting_policy

        return starting_policy(self.sft, log=lambda m: print(m, flush=True))

    def splits(self, regime: str) -> dict:
        from .tasks import REGIMES, make_study_splits

        splits = make_study_splits(self.sft.n_examples, self.n_train, self.sft.n_test, quick=self.quick)
        return {k: REGIMES[regime](splits[k][: self.n_test] if k == "test" else splits[k]) for k in ("train", "test")}

    def path(self, regime, batch, setting, seed) -> Path:
        return self.out / f"{regime}-b{batch}" / "runs" / f"{setting}-s{seed}.json"

    def data_key(self, regime) -> str:
        """A hash of the regime's rows: a changed task (tasks.py) invalidates its cached runs."""
        if regime not in self._data_keys:
            text = json.dumps(self.splits(regime), sort_keys=True).encode()
            self._data_keys[regime] = hashlib.sha256(text).hexdigest()[:12]
        return self._data_keys[regime]

    def fingerprint(self, regime, batch, setting, seed) -> str:
        from .settings import SETTINGS as ALL

        return store.fingerprint(self.sft.key(), regime, self.data_key(regime), self.n_test,
                                 asdict(run_config(batch, self.steps, self.lr_scale)), store.setting_key(ALL[setting]),
                                 seed)

    def train_one(self, regime, batch, setting, seed):
        from .settings import SETTINGS as ALL
        from .tasks import as_dataset
        from .train import run

        path, fp = self.path(regime, batch, setting, seed), self.fingerprint(regime, batch, setting, seed)
        if store.load(path, fp):
            return
        splits = self.splits(regime)
        started = time.perf_counter()
        record = run(ALL[setting], seed, self.policy(), as_dataset(splits["train"]), as_dataset(splits["test"]), [],
                     run_config(batch, self.steps, self.lr_scale), log=lambda m: None)
        record.update(fingerprint=fp, regime=regime, batch=batch)
        store.save(path, record)
        print(f"  {regime}-b{batch} {setting} s{seed}: {time.perf_counter() - started:.0f}s, final pref "
              f"{record['curve'][-1]['pref_acc']:.3f}", flush=True)

    def train(self, jobs, regimes, batches, settings, seeds, extra=()):
        from concurrent.futures import ThreadPoolExecutor

        self.policy()
        # Seeds outermost and stock first, so a study cut short has complete seeds to compare.
        groups = []
        for seed in seeds:
            for regime in regimes:
                todo = [f"{b}:{s}" for b in batches for s in settings
                        if not store.load(self.path(regime, b, s, seed), self.fingerprint(regime, b, s, seed))]
                if todo:
                    groups.append((regime, seed, todo))
        print(f"{sum(len(g[2]) for g in groups)} runs to do in {len(groups)} processes", flush=True)

        def one(group):
            regime, seed, todo = group
            command = [sys.executable, "-m", "evaluation.regimes", "--group", regime, str(seed), *todo,
                       "--out", str(self.out), "--steps", str(self.steps), "--lr-scale", str(self.lr_scale), *extra]
            return subprocess.run(command, cwd=REPO, check=False).returncode

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            failed = [group[:2] for group, code in zip(groups, pool.map(one, groups)) if code != 0]
        if failed:
            raise SystemExit(f"groups failed: {failed}")

    def timing(self, regimes, batches, settings):
        """Seconds per training step of each setting against stock's, round-robin in one process on the same batches
        (gradients.step_times), per cell: the clock of the "equal measured s" reading. Run it alone on the machine."""
        from .gradients import step_times
        from .settings import SETTINGS as ALL

        names = ["stock"] + [n for n in settings if n != "stock"]
        for regime in regimes:
            for batch in batches:
                path = self.out / f"timing-{regime}-b{batch}.json"
                fp = store.fingerprint(self.sft.key(), regime, self.data_key(regime), batch, names, TIMING_ROUNDS,
                                       TIMING_STEPS)
                if store.load(path, fp):
                    continue
                print(f"step timing {regime}-b{batch}, round-robin over {len(names)} settings", flush=True)
                cfg = run_config(batch, self.steps)
                rows = self.splits(regime)["train"][: 4 * batch]
                result = step_times([ALL[n] for n in names], self.policy(), rows, cfg, TIMING_ROUNDS, TIMING_STEPS,
                                    log=lambda m: print(m, flush=True))
                store.save(path, {"fingerprint": fp, "timing": result})

    def gradients(self, regimes):
        """B_simple and each setting's r per regime, at the starting policy, batches of 8 pairs."""
        from .gradients import diagnose
        from .settings import SETTINGS as ALL

        cfg = run_config(BASE_BATCH, self.steps)
        sgd_batches, diag_batches, draws = (4, 1, 2) if self.quick else (16, 4, 8)
        for regime in regimes:
            path = self.out / f"gradients-{regime}.json"
            fp = store.fingerprint(self.sft.key(), regime, sgd_batches, diag_batches, draws, DIAGNOSED)
            if store.load(path, fp):
                continue
            rows = self.splits(regime)["train"][: sgd_batches * cfg.batch_size]
            result = diagnose([ALL[n] for n in DIAGNOSED], self.policy(), self.policy(), rows, cfg, draws,
                              diag_batches, log=lambda m: print(m, flush=True))
            store.save(path, {"fingerprint": fp, "diagnostics": result})


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m evaluation.regimes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["all", "train", "gradients", "timing", "report"], default="all")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "regimes")
    parser.add_argument("--docs", type=Path, help="write the report into <docs>/quality.md (default: <out>/regimes.md)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--regimes", nargs="+", default=list(REGIME_NAMES[:2]), choices=REGIME_NAMES)
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--steps", type=int, default=STEPS, help="the equal-steps budget N, every batch size")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI's smoke test)")
    parser.add_argument("--lr-scale", type=float, default=1.0,
                        help="learning rates times this (use its own --out: the cells' folders do not name it)")
    parser.add_argument("--group", nargs="+", metavar="REGIME SEED BATCH:SETTING", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    for key, value in (("TQDM_DISABLE", "1"), ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
                       ("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1"), ("OMP_NUM_THREADS", "1")):
        os.environ.setdefault(key, value)
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "datasets", "accelerate", "trl_pruned_dpo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    study = Regimes(args.out, steps=args.steps, n_test=16 if args.quick else N_HELD_OUT, quick=args.quick,
                    lr_scale=args.lr_scale)
    if args.group:
        regime, seed, *runs = args.group
        for item in runs:
            batch, setting = item.split(":")
            study.train_one(regime, int(batch), setting, int(seed))
        return 0
    extra = ["--quick"] if args.quick else []
    if args.stage in ("all", "train"):
        study.train(args.jobs, args.regimes, args.batches, args.settings, args.seeds, extra)
    if args.stage in ("all", "gradients"):
        study.gradients(args.regimes)
    if args.stage in ("all", "timing"):
        study.timing(args.regimes, args.batches, args.settings)
    if args.stage in ("all", "report"):
        from .regimes_report import write

        write(study, args.regimes, args.batches, args.settings, args.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
