"""The quality study, end to end: ``python -m evaluation.quality`` (full) or ``python -m evaluation.quality --quick``.

Stages, each cached under ``--out`` so an interrupted study resumes where it stopped (a result is reused only if
the configuration that produced it is unchanged):

1. the starting policy (sft.py; cached in the demo cache), and its held-out metrics at step 0;
2. training runs: every setting x seed (train.py), stock first; ``runs/<setting>-s<seed>.json``;
3. step timing, round-robin (gradients.step_times); ``timing.json``;
4. gradient diagnostics at the starting policy, at stock's trained policy, and there on "far" pairs
   (gradients.diagnose); ``gradients-<state>.json``;
5. the report: PNG curves and the main study's section of ``quality.md`` (report.py, write_doc.py).

The full study writes docs/quality.md and docs/img/quality_*.png; ``--quick`` (tiny sizes, ~5 minutes) writes
under its ``--out`` only, so it never overwrites the published results. ``--stage`` runs one stage (e.g. to split
the full study into shorter commands); ``--seeds`` and ``--settings`` restrict stage 2.
"""

import argparse
import datetime
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import store  # the result store the regimes study shares
from .settings import DIAGNOSED
from .store import REPO


@dataclass(frozen=True)
class Profile:
    quick: bool = False
    n_sft: int = 16384
    sft_steps: int = 1000
    n_train: int = 2048
    n_test: int = 128  # held-out pairs for the preference metrics
    n_gen: int = 48  # held-out prompts for generation accuracy (the first n_gen of the test pairs)
    seeds: tuple = (0, 1, 2, 3, 4)
    settings: tuple = ()  # empty: settings.TRAINED
    diag_settings: tuple = ()  # empty: settings.DIAGNOSED
    diag_batches: int = 4  # batches that get mask draws
    sgd_batches: int = 16  # batches whose exact gradients measure stock's minibatch noise
    diag_draws: int = 8
    timing_rounds: int = 10
    timing_steps: int = 4
    run: dict = field(default_factory=dict)  # RunConfig overrides


FULL = Profile(run=dict(steps=150, pruned_steps_factor=1.5, eval_every=25, gen_every=50))
QUICK = Profile(quick=True, n_sft=4096, sft_steps=300, n_train=256, n_test=32, n_gen=32, diag_batches=2,
                sgd_batches=6, diag_draws=6, timing_rounds=2, timing_steps=2,
                run=dict(steps=30, eval_every=10, gen_every=10, eval_batch_size=16))
# CI's smoke test: the quick profile at the smallest sizes that still exercise every stage, and every setting the
# published tables name: trained, the three prototype laws of the training runs (annealing, masks per row, per pair);
# diagnosed, every one of them (a setting the docs cite cannot break unnoticed).
SMOKE = replace(QUICK, n_sft=256, sft_steps=10, n_train=32, n_test=16, n_gen=8, seeds=(0, 1),
                settings=("stock", "branch_cp_anneal", "position_cp_rows", "prefix_cp_shared"),
                diag_settings=tuple(DIAGNOSED),
                diag_batches=1, sgd_batches=2, diag_draws=2, timing_rounds=1, timing_steps=1,
                run=dict(steps=4, eval_every=2, gen_every=4, eval_batch_size=8))

def _log(message: str):
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


class Study:
    def __init__(self, profile: Profile, out: Path, docs: Path):
        from .settings import DIAGNOSED, QUICK_DIAGNOSED, QUICK_TRAINED, SETTINGS, TRAINED
        from .sft import SFTSpec
        from .tasks import make_study_splits
        from .train import RunConfig

        self.profile, self.out, self.docs = profile, out, docs
        self.cfg = RunConfig(**profile.run)
        self.trained = list(profile.settings or (QUICK_TRAINED if profile.quick else TRAINED))
        self.diagnosed = list(profile.diag_settings or (QUICK_DIAGNOSED if profile.quick else DIAGNOSED))
        unknown = [n for n in self.trained + self.diagnosed if n not in SETTINGS]
        if unknown:
            raise SystemExit(f"Unknown settings {unknown}; known: {sorted(SETTINGS)}")
        if self.trained[0] != "stock":
            self.trained = ["stock"] + [n for n in self.trained if n != "stock"]
        self.sft = SFTSpec(quick=profile.quick, n_examples=profile.n_sft, steps=profile.sft_steps,
                           n_train=profile.n_train, n_test=profile.n_test)
        self.splits = make_study_splits(profile.n_sft, profile.n_train, profile.n_test, quick=profile.quick)
        self.base_fp = [self.sft.key(), profile.n_train, profile.n_test, profile.n_gen, asdict(self.cfg)]

    # ------------------------------------------------------------------------------------------------------ stages
    def policy(self) -> str:
        from .sft import starting_policy

        return starting_policy(self.sft, log=_log)

    def start_metrics(self) -> dict:
        from transformers import AutoTokenizer

        from .evaluate import generation_accuracy, logprob_preference
        from .sft import load_policy

        path, fp = self.out / "start.json", store.fingerprint(self.base_fp)
        cached = store.load(path, fp)
        if cached:
            return cached["metrics"]
        folder = self.policy()
        model, tokenizer = load_policy(folder), AutoTokenizer.from_pretrained(folder)
        test = self.splits["test"]
        metrics = {"pref_acc": 0.0, "margin": 0.0}  # the policy is the reference: every implicit reward is 0
        metrics.update(generation_accuracy(model, tokenizer, test[: self.profile.n_gen]))
        metrics["logprob_pref"] = logprob_preference(model, tokenizer, test)
        _log(f"starting policy: gen acc {metrics['gen_acc']:.3f}, log-prob preference {metrics['logprob_pref']:.3f}")
        store.save(path, {"fingerprint": fp, "metrics": metrics})
        return metrics

    def train_parallel(self, jobs: int, seeds=None, names=None, argv_extra=()):
        """Stage 2 in `jobs` worker processes (one run each, one torch thread each), same caching."""
        from concurrent.futures import ThreadPoolExecutor

        self.policy()  # train the starting policy once, before the workers look for it
        self.start_metrics()
        todo = [(seed, name) for seed in (seeds if seeds is not None else self.profile.seeds)
                for name in (names or self.trained)]

        def one(item):
            seed, name = item
            command = [sys.executable, "-m", "evaluation.quality", "--stage", "train", "--seeds", str(seed),
                       "--settings", name, "--out", str(self.out), *argv_extra]
            return subprocess.run(command, cwd=REPO, check=False).returncode

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            failed = [item for item, code in zip(todo, pool.map(one, todo)) if code != 0]
        if failed:
            raise SystemExit(f"training runs failed: {failed}")

    def train(self, seeds=None, names=None):
        from .settings import SETTINGS
        from .tasks import as_dataset
        from .train import run

        folder = self.policy()
        train_ds, test_ds = as_dataset(self.splits["train"]), as_dataset(self.splits["test"])
        gen_rows = self.splits["test"][: self.profile.n_gen]
        for seed in seeds if seeds is not None else self.profile.seeds:
            for name in names or self.trained:
                setting = SETTINGS[name]
                path = self.out / "runs" / f"{name}-s{seed}.json"
                fp = store.fingerprint(self.base_fp, store.setting_key(setting), seed)
                if store.load(path, fp):
                    continue
                _log(f"train {name} (seed {seed}): {setting.label}")
                started = time.perf_counter()
                record = run(setting, seed, folder, train_ds, test_ds, gen_rows, self.cfg, log=_log,
                             save_dir=str(self.out / "policies" / f"stock-s{seed}") if name == "stock" else None)
                record["fingerprint"] = fp
                store.save(path, record)
                _log(f"  done in {time.perf_counter() - started:.0f}s (train {record['train_time']:.0f}s)")

    def timing(self):
        from .gradients import step_times
        from .settings import EXACT_BASELINES, SETTINGS

        path = self.out / "timing.json"
        names = self.trained + [n for n in EXACT_BASELINES if n not in self.trained]
        fp = store.fingerprint(self.base_fp, names, self.profile.timing_rounds, self.profile.timing_steps)
        if store.load(path, fp):
            return
        _log(f"step timing, round-robin over {len(names)} settings")
        rows = self.splits["train"][: self.profile.diag_batches * self.cfg.batch_size]
        result = step_times([SETTINGS[n] for n in names], self.policy(), rows, self.cfg,
                            self.profile.timing_rounds, self.profile.timing_steps, log=_log)
        store.save(path, {"fingerprint": fp, "timing": result})

    def gradients(self, only=None):
        """One cached file per policy state: gradients-start.json, gradients-trained.json, gradients-far.json."""
        from .gradients import diagnose
        from .settings import FAR_DIAGNOSED, SETTINGS
        from .tasks import far_pairs

        rows = self.splits["train"][: max(self.profile.sgd_batches, self.profile.diag_batches) * self.cfg.batch_size]
        trained = self.out / "policies" / f"stock-s{self.profile.seeds[0]}"
        states = [("start", self.policy(), rows, self.diagnosed)]
        if (trained / "model.safetensors").is_file():
            far = [n for n in FAR_DIAGNOSED if n in self.diagnosed] or self.diagnosed[:2]
            states += [("trained", str(trained), rows, self.diagnosed), ("far", str(trained), far_pairs(rows), far)]
        for state, policy, state_rows, names in states:
            if only and state not in only:
                continue
            path = self.out / f"gradients-{state}.json"
            # Results are kept per setting: adding a setting computes only that one.
            fp = store.fingerprint(self.base_fp, self.profile.diag_batches, self.profile.diag_draws,
                                   self.profile.sgd_batches, state)
            cached = store.load(path, fp)
            done = cached["diagnostics"] if cached else {}
            missing = [n for n in names if n not in done]
            if not missing:
                continue
            _log(f"gradient diagnostics: {state} ({len(missing)} settings)")

            def save(partial, path=path, fp=fp, done=done):
                store.save(path, {"fingerprint": fp, "diagnostics": {**done, **partial}})

            diagnose([SETTINGS[n] for n in missing], policy, self.policy(), state_rows, self.cfg,
                     self.profile.diag_draws, self.profile.diag_batches, log=_log, on_result=save)

    def report(self):
        from .write_doc import write

        write(self)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m evaluation.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, ~5 minutes; writes under --out only")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # CI: --quick at the smallest sizes
    parser.add_argument("--stage", choices=["all", "sft", "train", "timing", "gradients", "report"], default="all")
    parser.add_argument("--out", type=Path, help="results folder (default runs/quality or runs/quality-quick)")
    parser.add_argument("--docs", type=Path, help="where quality.md and img/ go (default docs/, or <out>/docs)")
    parser.add_argument("--seeds", type=int, nargs="+", help="restrict the training stage to these seeds")
    parser.add_argument("--settings", nargs="+", help="restrict the training stage to these settings")
    parser.add_argument("--steps", type=int, help="override the equal-steps budget N")
    parser.add_argument("--sft-steps", type=int, help="override the warm-start SFT steps")
    parser.add_argument("--n-train", type=int, help="override the number of DPO training pairs")
    parser.add_argument("--all-seeds", type=int, nargs="+", help="override the study's seeds (all stages)")
    parser.add_argument("--states", nargs="+", choices=["start", "trained", "far"],
                        help="restrict the gradients stage to these policy states")
    parser.add_argument("--jobs", type=int, default=1,
                        help="training runs in parallel (separate processes, one thread each); timings get noisier")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    args = parser.parse_args(argv)

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
    torch.set_num_threads(args.threads)

    args.quick |= args.smoke
    profile = SMOKE if args.smoke else QUICK if args.quick else FULL
    run_overrides = dict(profile.run)
    if args.steps:
        run_overrides["steps"] = args.steps
        run_overrides.setdefault("eval_every", max(1, args.steps // 10))
    profile = replace(
        profile,
        run=run_overrides,
        sft_steps=args.sft_steps or profile.sft_steps,
        n_train=args.n_train or profile.n_train,
        seeds=tuple(args.all_seeds) if args.all_seeds else profile.seeds,
    )
    out = args.out or REPO / "runs" / ("quality-quick" if args.quick else "quality")
    docs = args.docs or (out / "docs" if args.quick else REPO / "docs")
    study = Study(profile, out, docs)
    _log(f"quality study ({'quick' if args.quick else 'full'}): out {out}, docs {docs}")
    stages = ["sft", "train", "timing", "gradients", "report"] if args.stage == "all" else [args.stage]
    for stage in stages:
        if stage == "sft":
            study.policy()
            study.start_metrics()
        elif stage == "train" and args.jobs > 1:
            extra = ["--smoke"] if args.smoke else ["--quick"] if args.quick else []
            extra += ["--threads", str(args.threads)]
            for flag, value in (("--steps", args.steps), ("--sft-steps", args.sft_steps), ("--n-train", args.n_train)):
                if value:
                    extra += [flag, str(value)]
            if args.all_seeds:
                extra += ["--all-seeds", *map(str, args.all_seeds)]
            study.train_parallel(args.jobs, seeds=args.seeds, names=args.settings, argv_extra=extra)
        elif stage == "train":
            study.start_metrics()
            study.train(seeds=args.seeds, names=args.settings)
        elif stage == "timing":
            study.timing()
        elif stage == "gradients":
            study.gradients(only=args.states)
        else:
            study.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
