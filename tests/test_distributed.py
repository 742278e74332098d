"""Two processes on CPU, launched with `accelerate launch` and the shipped configs/accelerate/*.yaml: the pruned
trainer under DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, all over gloo.

Per engine, one launch of tests/distributed/run_pruned.py trains several tiny runs in the same two processes (the
start-up is most of the cost) and records, per rank, every mask draw with its batch and the final weights. Checked:

- every run finishes on both ranks, in sync (identical weights: the gradients were all-reduced), with the grad /
  no-grad / reference forwards mixed, gradient checkpointing on (TRL's default) and off, gradient accumulation
  (`no_sync` micro-steps), a rank whose backpropagated group is empty, a PEFT reference and a precomputed one;
- masks: each rank draws its own, reproducible from (prune_seed, step, micro-step, rank); micro-steps draw fresh
  masks; a resumed run continues the stream (same masks, same weights as the uninterrupted run);
- pruning off, two processes: the same losses, metrics and weights as stock `trl.DPOTrainer` on two processes (every
  pruning and exact saving off: stock's code; `share_prompt` alone; and `PrunedDPOConfig`'s defaults, exact savings on);
- FSDP2, ZeRO-2 and ZeRO-3 (FSDP2 and ZeRO-3: parameters really sharded, each rank holds half of them) end every run
  on DDP's weights;
- the merged step (merged_step.py): under DDP and DeepSpeed each step's micro-batches run in one pass, with the
  unmerged run's masks, losses and weights (DDP: all-reduced as often as unmerged, once per step; DeepSpeed: the step's
  end set by accelerate at each backward); FSDP falls back, and DeepSpeed at a budget that does not hold a whole step,
  each saying why once.

On CPU: accelerate runs FSDP only on accelerator devices, so the runner's test-only shim (`allow_fsdp_on_cpu`) lets
it through (torch's FSDP2 itself works over gloo); DeepSpeed runs with `DS_ACCELERATOR=cpu` and is skipped where it
is not installed (CI installs it and fails instead: TEST_DISTRIBUTED_REQUIRE_DEEPSPEED=1). docs/distributed.md says what this does and does not cover, and the GPU commands.
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from trl_pruned_dpo.method.masks import draw_masks, mask_generator

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "distributed" / "run_pruned.py"
WORLD = 2
SEED = 0  # the runner's `seed`, hence `prune_seed`

PRUNED = {"branch_keep_prob": 0.5, "position_keep_prob": 0.7, "prefix_prune_prob": 0.5}
ACCUM = {"gradient_accumulation_steps": 2, "max_steps": 4}
MERGED = {"position_keep_prob": 0.7, "prefix_prune_prob": 0.5, "share_prompt": True, "padding_free": True, **ACCUM}
# Ragged prompts, accumulation 4, the default budget: at step 2 rank 0's own tokens group [3, 1], rank 1's [2, 2]
RAGGED = {**MERGED, "gradient_accumulation_steps": 4, "max_steps": 2}
# Where the ragged cells run: every engine merges (the ranks agree on their passes, merged_step.py); the LoRA
# reference and branch pruning's frozen forward are left out under ZeRO-2 (its forward is DDP's) to keep CI short.
MERGING = ("ddp", "fsdp", "zero2", "zero3")
MERGING_HEAVY = ("ddp", "fsdp", "zero3")
AUTO = {"branch_keep_prob": "auto", "gradient_accumulation_steps": 2, "max_steps": 8,
        "gradient_checkpointing_kwargs": {"use_reentrant": True}}
RUNS = [
    # pruning off vs stock: gradient accumulation, so the loss scaling across ranks and micro-steps is compared too
    {"name": "stock", "trainer": "stock", "config": {"gradient_accumulation_steps": 2, "max_steps": 2}},
    {"name": "off", "trainer": "pruned", "config": {"gradient_accumulation_steps": 2, "max_steps": 2}},
    # PrunedDPOConfig's defaults: pruning off, the exact savings (share_prompt, padding_free) on
    {"name": "default", "trainer": "pruned", "config": {"gradient_accumulation_steps": 2, "max_steps": 2}},
    # every pruning on, gradient accumulation, a checkpoint at step 2 to resume from
    {"name": "pruned", "config": {**PRUNED, **ACCUM, "save_strategy": "steps", "save_steps": 2}},
    {"name": "resumed", "config": {**PRUNED, **ACCUM}, "resume": "pruned/checkpoint-2"},
    # one pair per rank, independent branches at 0.3: some steps a rank backpropagates nothing (its grad group is the
    # 1-row dummy) while the other does; no checkpointing, so DDP looks for unused parameters
    {"name": "sparse", "config": {"branch_keep_prob": 0.3, "branch_sampling": "independent",
                                  "per_device_train_batch_size": 1, "max_steps": 6, "gradient_checkpointing": False}},
    {"name": "peft", "reference": "peft", "config": {**PRUNED, "max_steps": 2}},
    {"name": "precompute", "reference": "precompute", "config": {**PRUNED, "max_steps": 2}},
    # share_prompt: exact against stock with pruning off; with every pruning on, mixed shared / split pairs
    {"name": "shared-off", "trainer": "pruned",
     "config": {"share_prompt": True, "gradient_accumulation_steps": 2, "max_steps": 2}},
    {"name": "shared", "config": {**PRUNED, **ACCUM, "share_prompt": True}},
    # padding_free (the packed forward without shared prompts), pruning on
    {"name": "packed", "config": {**PRUNED, "padding_free": True, "max_steps": 2}},
    # the merged step (merged_step.py): each optimizer step's two micro-batches in one pass under every engine,
    # against its unmerged twin
    {"name": "merged", "config": {**MERGED, "step_token_budget": 10**9, "save_strategy": "steps", "save_steps": 2}},
    {"name": "merged-off", "config": {**MERGED, "step_token_budget": 0}},
    # a merged run resumed from its mid-run checkpoint (every engine's own checkpoint format)
    {"name": "merged-resumed", "config": {**MERGED, "step_token_budget": 10**9}, "resume": "merged/checkpoint-2"},
    # ranks whose micro-batches group differently (every engine): the LoRA reference
    # (the policy, adapter disabled: TRL's LoRA recipe) and a separate one, each against its unmerged twin
    {"name": "ragged-peft", "reference": "peft", "data": "ragged", "config": RAGGED, "engines": MERGING_HEAVY},
    {"name": "ragged-peft-off", "reference": "peft", "data": "ragged", "config": {**RAGGED, "step_token_budget": 0},
     "engines": MERGING_HEAVY},
    {"name": "ragged", "data": "ragged", "config": RAGGED, "engines": MERGING},
    {"name": "ragged-off", "data": "ragged", "config": {**RAGGED, "step_token_budget": 0}, "engines": MERGING},
    # branch pruning merged: one grad and one frozen forward per pass, the frozen one outside DDP's wrapper
    {"name": "ragged-branch", "data": "ragged", "config": {**RAGGED, "branch_keep_prob": 0.5},
     "engines": MERGING_HEAVY},
    {"name": "ragged-branch-off", "data": "ragged", "config": {**RAGGED, "branch_keep_prob": 0.5,
                                                               "step_token_budget": 0}, "engines": MERGING_HEAVY},
    # auto (auto.py): the ranks hold different pairs; norms from the micro-batch vs the accumulated, all-reduced
    # gradient, reentrant checkpointing; a checkpoint mid-run to resume from; and one pair per rank, no accumulation
    {"name": "auto", "config": {**AUTO, "save_strategy": "steps", "save_steps": 4}},
    {"name": "auto-resumed", "config": AUTO, "resume": "auto/checkpoint-4"},
    {"name": "auto-single", "config": {"branch_keep_prob": "auto", "per_device_train_batch_size": 1, "max_steps": 8}},
]
# The exact savings are on by default: every plugin run but "default" spells them out (off unless it sets one), so
# each run is what its name says ("off": stock's code).
SAVINGS_OFF = {"share_prompt": False, "padding_free": False}
for _run in RUNS:
    if _run.get("trainer", "pruned") == "pruned" and _run["name"] != "default":
        _run["config"] = {**SAVINGS_OFF, **_run["config"]}
CONFIGS = {run["name"]: run["config"] for run in RUNS}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Engines, by their accelerate config in configs/accelerate/ (bf16 and 8 processes there; overridden below)
CONFIG_DIR = ROOT / "configs" / "accelerate"
ENGINES = ("ddp", "fsdp", "zero2", "zero3")
# TEST_DISTRIBUTED_DEVICE=cuda runs the same checks on two GPUs (NCCL, no CPU shims). Written, not yet run: no GPU
# was available when this file was written (docs/distributed.md).
ON_GPU = os.environ.get("TEST_DISTRIBUTED_DEVICE", "cpu") == "cuda"
if ON_GPU and torch.cuda.device_count() < WORLD:
    pytest.skip(f"TEST_DISTRIBUTED_DEVICE=cuda needs {WORLD} GPUs", allow_module_level=True)
EXPECTED_TYPE = {
    "ddp": "DistributedType.MULTI_GPU" if ON_GPU else "DistributedType.MULTI_CPU", "fsdp": "DistributedType.FSDP",
    "zero2": "DistributedType.DEEPSPEED", "zero3": "DistributedType.DEEPSPEED",
}
SHARDED = {"fsdp", "zero3"}  # each rank holds only its shard of the parameters
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# CI sets TEST_DISTRIBUTED_REQUIRE_DEEPSPEED=1 (.ci/run installs DeepSpeed): there a missing DeepSpeed fails the ZeRO
# cells instead of skipping them, so a green CI means they ran.
REQUIRE_DEEPSPEED = os.environ.get("TEST_DISTRIBUTED_REQUIRE_DEEPSPEED") == "1"
# Engines tested, e.g. TEST_DISTRIBUTED_ENGINES=ddp,zero2. The DeepSpeed ones are skipped where DeepSpeed is not
# installed (failed under TEST_DISTRIBUTED_REQUIRE_DEEPSPEED=1).
TESTED = os.environ.get("TEST_DISTRIBUTED_ENGINES", ",".join(ENGINES)).split(",")
if unknown := set(TESTED) - set(ENGINES):
    raise ValueError(f"TEST_DISTRIBUTED_ENGINES: unknown {sorted(unknown)}; choose among {list(ENGINES)}")


def runs_on(engine: str) -> list[dict]:
    """The runs launched under `engine`: all but those a run's `engines` leaves out."""
    return [run for run in RUNS if engine in run.get("engines", ENGINES)]


# A hang never ends: the limit only has to outlast the slowest honest launch. ZeRO-3's, the longest, took 190 s with
# the whole suite on two cores (2026-12-06), and the suite's wall time has varied 4.6x between CI runs (767-3521 s).
LAUNCH_TIMEOUT = 900


def launch(engine: str, out: Path, runs: list, timeout: int = LAUNCH_TIMEOUT) -> None:
    spec = out / "spec.json"
    spec.write_text(json.dumps(runs))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if not ON_GPU:
        env |= {
            # DDP / FSDP: the trainer then asks accelerate for MULTI_CPU (gloo); DeepSpeed: its CPU accelerator (gloo)
            "ACCELERATE_USE_CPU": "0" if engine.startswith("zero") else "1",
            "DS_ACCELERATOR": "cpu",
            "CUDA_VISIBLE_DEVICES": "",
            "RUN_PRUNED_FSDP_ON_CPU": "1" if engine == "fsdp" else "0",
        }
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG_DIR / f"{engine}.yaml"),
        "--num_processes", str(WORLD), "--mixed_precision", "no", "--main_process_port", str(free_port()),
        str(RUNNER), "--spec", str(spec), "--out", str(out),
    ]
    # Own process group, so that a hang (the failure mode of a rank running other modules) is killed whole (below)
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        # torch's elastic agent starts each worker in a session of its own: kill them by descent, or a hung worker
        # outlives the group and holds the output pipe open
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        hung = True
    (out / "launch.log").write_text(log)
    if hung:
        pytest.fail(f"accelerate launch ({engine}) hung for {timeout}s:\n{log[-6000:]}")
    assert proc.returncode == 0, f"accelerate launch ({engine}) failed ({proc.returncode}):\n{log[-6000:]}"


_LAUNCHED: dict[str, Path | str] = {}  # engine -> output folder, or the failure message (launched once per session)


def needs_deepspeed() -> None:
    """Skip where DeepSpeed is not installed; fail instead under TEST_DISTRIBUTED_REQUIRE_DEEPSPEED=1 (CI)."""
    if HAS_DEEPSPEED:
        return
    message = "DeepSpeed is not installed (`pip install deepspeed`: it runs on CPU, see docs/distributed.md)"
    if REQUIRE_DEEPSPEED:
        pytest.fail(f"{message}, and TEST_DISTRIBUTED_REQUIRE_DEEPSPEED=1 requires it")
    pytest.skip(message)


def launched(engine: str, tmp_path_factory) -> Path:
    """The output folder of the engine's launch."""
    if engine.startswith("zero"):
        needs_deepspeed()
    if engine not in _LAUNCHED:
        out = tmp_path_factory.mktemp(engine)
        try:
            launch(engine, out, runs_on(engine))
            _LAUNCHED[engine] = out
        except (AssertionError, pytest.fail.Exception) as error:
            _LAUNCHED[engine] = f"{engine}: the launch failed earlier (log: {out / 'launch.log'})"
            raise error
    if isinstance(_LAUNCHED[engine], str):
        pytest.fail(_LAUNCHED[engine])
    return _LAUNCHED[engine]


def test_lm_head_probe_runs_under_zero3(monkeypatch):
    """The plugin's lm-head probe (`seam.check_compact_lm_head`, run in every trainer's constructor) under a ZeRO-3
    config, in this one process: TRL's fused head then goes through `maybe_gather_lm_head_ctx`, which reads DeepSpeed's
    `ds_status` from every parameter it is handed. Before the fix every rank's constructor failed there
    (`'Parameter' object has no attribute 'ds_status'`); the probe's local model now marks its parameters whole
    (`seam.mark_whole_under_zero3`). Also pins the TRL private that relies on: a parameter `AVAILABLE` is not
    gathered (a null context)."""
    needs_deepspeed()
    if not ON_GPU:
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from contextlib import nullcontext

    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from transformers.integrations.deepspeed import (HfDeepSpeedConfig, is_deepspeed_zero3_enabled,
                                                     unset_hf_deepspeed_config)
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    from trl_pruned_dpo import seam

    # transformers holds the config by a weak reference: keep it alive for the test
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_batch_size": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        whole = torch.nn.Parameter(torch.ones(2))
        whole.ds_status = ZeroParamStatus.AVAILABLE
        assert isinstance(maybe_gather_lm_head_ctx(whole, None), nullcontext)
        assert seam.head_rows_scored(labels_kept=3) == 3  # not 8: the head still scores only the labelled positions
        monkeypatch.setattr(seam, "_COMPACT_HEAD_OK", False)
        seam.check_compact_lm_head()
    finally:
        unset_hf_deepspeed_config()
        del zero3


@pytest.fixture(scope="module", params=TESTED)
def engine_run(request, tmp_path_factory):
    return request.param, launched(request.param, tmp_path_factory)


def report(out: Path, name: str, rank: int) -> dict:
    return json.loads((out / name / f"rank{rank}.json").read_text())


def weights(out: Path, name: str, rank) -> dict:
    suffix = "initial" if rank == "initial" else f"rank{rank}"
    return torch.load(out / name / f"weights_{suffix}.pt")


def losses(history: list) -> list:
    return [h for h in history if "loss" in h]


@pytest.mark.slow
@pytest.mark.parametrize("name", [run["name"] for run in RUNS])
def test_finishes_on_both_ranks_in_sync(engine_run, name):
    engine, out = engine_run
    if name not in {run["name"] for run in runs_on(engine)}:
        pytest.skip(f"{name} runs under {engine} the way it runs elsewhere")
    config = CONFIGS[name]
    for rank in range(WORLD):
        r = report(out, name, rank)
        assert (r["rank"], r["world_size"]) == (rank, WORLD)
        assert r["distributed_type"] == EXPECTED_TYPE[engine]
        wrapper = {"ddp": "DistributedDataParallel", "fsdp": "FSDP"}.get(engine, "DeepSpeedEngine")
        assert r["model_class"].startswith(wrapper)
        if engine in SHARDED:
            assert r["local_numel"] <= r["full_numel"] // WORLD + 64
        else:
            assert r["local_numel"] == r["full_numel"]
        assert r["global_step"] == config.get("max_steps", 2)
        assert all(torch.isfinite(torch.tensor(h["loss"])) for h in losses(r["log_history"]))
    w0, w1, w_init = weights(out, name, 0), weights(out, name, 1), weights(out, name, "initial")
    assert w0.keys() == w1.keys() == w_init.keys()
    for key in w0:  # the gradients were all-reduced: both ranks took the same optimizer steps
        torch.testing.assert_close(w0[key], w1[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(w0[k], w_init[k]) for k in w0), "training did not move the weights"


@pytest.mark.slow
@pytest.mark.parametrize("off_run", ["off", "shared-off", "default"])
def test_pruning_off_matches_stock_on_two_processes(engine_run, off_run):
    _, out = engine_run
    for rank in range(WORLD):
        stock, off = losses(report(out, "stock", rank)["log_history"]), losses(report(out, off_run, rank)["log_history"])
        assert len(stock) == len(off) == 2
        for hs, ho in zip(stock, off):
            for key, value in hs.items():
                if isinstance(value, float) and key not in ("epoch", "learning_rate"):
                    assert ho[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (rank, hs["step"], key)
            if off_run == "off":  # pruning off is TRL's own path: stock's metrics
                assert not any(k.startswith("prune/") for k in ho)
            else:  # share_prompt (alone or with padding_free) runs the plugin's forward, exactly: stock's metrics plus
                # the prune/ token fractions (those that would read 1 are "debug" keys: docs/metrics.md)
                assert 0 < ho["prune/tokens_executed"] <= 1 and "prune/positions_scored" not in ho
    w_stock, w_off = weights(out, "stock", 0), weights(out, off_run, 0)
    # the packed attention rounds differently from stock's padded SDPA, and Adam's first steps move a weight by about
    # lr * sign(g) whatever |g|: a round-off-sized gradient entry (one of 2048 seen) ends a few 1e-6 away
    atol = 1e-6 if off_run == "off" else 1e-5
    for key in w_stock:
        torch.testing.assert_close(w_off[key], w_stock[key], rtol=1e-4, atol=atol, msg=key)


def redraw(draw: dict, config: dict, rank: int):
    """The masks `draw` should hold, from (seed, step, micro-step, rank) and the recorded batch alone."""
    return draw_masks(
        torch.tensor(draw["input_ids"]),
        torch.tensor(draw["completion_mask"]),
        position_keep_prob=config.get("position_keep_prob", 1.0),
        prefix_prune_prob=config.get("prefix_prune_prob", 0.0),
        prefix_min_ratio=0.5,
        branch_keep_prob=config.get("branch_keep_prob", 1.0),
        branch_sampling=config.get("branch_sampling", "paired"),
        drop_common_prefix=False,
        generator=mask_generator(SEED, draw["step"], draw["micro"], rank),
    )


def same(draw: dict, masks) -> bool:
    return draw["scored"] == masks.scored.int().tolist() and draw["backprop"] == masks.backprop.int().tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pruned", "sparse", "peft", "precompute"])
def test_masks_are_per_rank_and_reproducible(engine_run, name):
    _, out = engine_run
    config = CONFIGS[name]
    accum, steps = config.get("gradient_accumulation_steps", 1), config.get("max_steps", 2)
    draws = {rank: report(out, name, rank)["draws"] for rank in range(WORLD)}
    other_rank_differs = 0
    for rank in range(WORLD):
        # one fresh draw per micro-step, in order
        assert [(d["step"], d["micro"]) for d in draws[rank]] == [(s, m) for s in range(steps) for m in range(accum)]
        for d in draws[rank]:
            assert same(d, redraw(d, config, rank)), (rank, d["step"], d["micro"])
            other_rank_differs += not same(d, redraw(d, config, 1 - rank))
    # the ranks' streams are not the same stream: another rank's generator on this batch draws other masks
    assert other_rank_differs >= len(draws[0])  # at least half of the (rank, micro-step) draws
    backprop = {rank: [d["backprop"] for d in draws[rank]] for rank in range(WORLD)}
    assert backprop[0] != backprop[1]
    if accum > 1:  # micro-steps of one step draw from different generators
        for rank in range(WORLD):
            pairs = [(d, e) for d, e in zip(draws[rank], draws[rank][1:]) if d["step"] == e["step"]]
            assert any(not same(e, redraw(e | {"micro": d["micro"]}, config, rank)) for d, e in pairs)




@pytest.mark.slow
def test_merged_step_equals_unmerged_and_reduces_once_per_step(engine_run):
    """Under DDP and DeepSpeed each step's two micro-batches run in one pass (FSDP: one each, the fallback) with the
    masks drawn unmerged, DDP all-reduces as often as unmerged (once per step: the unmerged run's first micro-step is
    under `no_sync`), and the losses and weights are the unmerged run's, to round-off. Under DeepSpeed the pass's one
    backward carries the step's end (accelerate sets `set_gradient_accumulation_boundary` from transformers'
    per-micro-batch `sync_gradients`): were DeepSpeed counting backwards instead, it would step every other optimizer
    step and the weights would part."""
    engine, out = engine_run
    for rank in range(WORLD):
        merged, unmerged = report(out, "merged", rank), report(out, "merged-off", rank)
        assert merged["merged_step_said"] == []  # every engine merges
        assert {d["pass"] for d in merged["draws"]} == {2}
        assert {d["pass"] for d in unmerged["draws"]} == {1}
        strip = [{k: v for k, v in d.items() if k != "pass"} for d in merged["draws"]]
        assert strip == [{k: v for k, v in d.items() if k != "pass"} for d in unmerged["draws"]]
        assert merged["reductions"] == unmerged["reductions"]
        if engine == "ddp":
            assert unmerged["reductions"] > 0 and unmerged["reductions"] % CONFIGS["merged"]["max_steps"] == 0
        for hm, hu in zip(losses(merged["log_history"]), losses(unmerged["log_history"]), strict=True):
            assert hm["loss"] == pytest.approx(hu["loss"], rel=1e-5), (rank, hm["step"])
    w_merged, w_unmerged = weights(out, "merged", 0), weights(out, "merged-off", 0)
    for key in w_merged:
        torch.testing.assert_close(w_merged[key], w_unmerged[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ragged-peft", "ragged", "ragged-branch"])
def test_ranks_whose_micro_batches_group_differently_run_the_same_passes(engine_run, name):
    """Issue 48's hang: under DDP, ranks whose own tokens group a step's 4 micro-batches differently (rank 0 [3, 1],
    rank 1 [2, 2]) deadlocked at step 1 with the LoRA reference (the policy's forward through DDP broadcast buffers
    between TRL's per-micro-batch metric gathers at a rank-dependent place). Every rank now runs the same passes (the
    step's token counts agreed across ranks, merged_step.py) and the reference through the unwrapped policy; the run
    finishes (under the launch's timeout) with the unmerged run's masks, losses and weights."""
    engine, out = engine_run
    if name not in {run["name"] for run in runs_on(engine)}:
        pytest.skip(f"{name} is not launched under {engine}")
    steps = [report(out, name, rank)["passes"] for rank in range(WORLD)]
    assert len(steps[0]) == len(steps[1]) == RAGGED["max_steps"]
    assert any(s0["own"] != s1["own"] for s0, s1 in zip(*steps)), "the data no longer groups differently per rank"
    assert [s["ran"] for s in steps[0]] == [s["ran"] for s in steps[1]]
    assert any(len(s["ran"]) < RAGGED["gradient_accumulation_steps"] for s in steps[0]), "nothing merged"
    for rank in range(WORLD):
        merged, unmerged = report(out, name, rank), report(out, f"{name}-off", rank)
        strip = [{k: v for k, v in d.items() if k != "pass"} for d in merged["draws"]]
        assert strip == [{k: v for k, v in d.items() if k != "pass"} for d in unmerged["draws"]]
        assert merged["reductions"] == unmerged["reductions"]
        for hm, hu in zip(losses(merged["log_history"]), losses(unmerged["log_history"]), strict=True):
            assert hm["loss"] == pytest.approx(hu["loss"], rel=1e-5), (rank, hm["step"])
    w_merged, w_unmerged = weights(out, name, 0), weights(out, f"{name}-off", 0)
    for key in w_merged:
        torch.testing.assert_close(w_merged[key], w_unmerged[key], rtol=1e-4, atol=1e-5, msg=key)


def test_the_default_run_falls_back_under_no_engine(engine_run):
    """The `default` run (PrunedDPOConfig's defaults: gradient accumulation, the default budget, the widest
    micro-batch's tokens) may merge under DDP, FSDP2 and DeepSpeed ZeRO-2/3 alike, and says nothing: the ranks agree on
    their passes each step (merged_step.agreed_across_ranks), so no engine falls back (DeepSpeed said a fallback here
    before). Whether its two micro-batches fit one pass is the budget's business (its near-uniform pairs do not: one
    pass each); the `merged` and `ragged-*` runs merge."""
    engine, out = engine_run
    for rank in range(WORLD):
        assert report(out, "default", rank)["merged_step_said"] == []


def test_accelerate_sets_deepspeeds_step_boundary_at_each_backward():
    """What DeepSpeed's merged step relies on (merged_step.DEEPSPEED_EXPLICIT_BOUNDARY): accelerate's DeepSpeed
    wrapper (a private class) tells the engine, before each backward, whether it ends the optimizer step (transformers'
    per-micro-batch `sync_gradients`), and steps the engine only then; no DeepSpeed needed."""
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    calls = []

    class Engine:
        def set_gradient_accumulation_boundary(self, is_boundary):
            calls.append(("boundary", is_boundary))

        def backward(self, loss, **kwargs):
            calls.append(("backward", kwargs))

        def step(self):
            calls.append(("step",))

    wrapper = DeepSpeedEngineWrapper(Engine())
    wrapper.backward(torch.ones(()), sync_gradients=False, scale_wrt_gas=False)
    wrapper.backward(torch.ones(()), sync_gradients=True, scale_wrt_gas=False)
    assert calls == [("boundary", False), ("backward", {"scale_wrt_gas": False}),
                     ("boundary", True), ("backward", {"scale_wrt_gas": False}), ("step",)]


@pytest.mark.parametrize(("accelerate_version", "processes", "budget", "merges"), [
    ("1.16.0", 2, 10**9, True),
    ("1.16.0", 2, None, True),  # the default budget: the ranks agree on their passes
    ("1.16.0", 1, None, True),
    ("1.7.0", 1, 10**9, False),  # accelerate before the explicit boundary
    ("1.7.0", 2, None, False),
])
def test_deepspeed_merges_where_accelerate_sets_the_step_boundary(monkeypatch, accelerate_version, processes, budget,
                                                                   merges):
    """merged_step.why_unmerged under DeepSpeed, without a launch: merged with accelerate >= 1.8 (it sets the step's end
    at each backward), whatever the budget and processes; otherwise one line naming why."""
    from types import SimpleNamespace

    import accelerate
    from accelerate.utils import DistributedType

    from trl_pruned_dpo import PrunedDPOConfig
    from trl_pruned_dpo.forward_choice import ForwardChoice
    from trl_pruned_dpo.merged_step import why_unmerged

    monkeypatch.setattr(accelerate, "__version__", accelerate_version)
    args = PrunedDPOConfig(output_dir="unused", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                           step_token_budget=budget, use_cpu=True, report_to="none")
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=processes,
                                  parallelism_config=None)
    why = why_unmerged(args, ForwardChoice(pruned=True, packed=True), accelerator, aux_loss_enabled=False, fsdp=False)
    assert (why is None) == merges, why
    if not merges:
        assert "set_gradient_accumulation_boundary" in why and "counting `engine.step()` calls" in why


@pytest.mark.slow
def test_a_rank_with_nothing_to_backpropagate_keeps_step(engine_run):
    """Its empty grad group runs the 1-row dummy forward: no hang, no DDP/FSDP error, ranks in sync (checked above)."""
    _, out = engine_run
    draws = {rank: report(out, "sparse", rank)["draws"] for rank in range(WORLD)}
    lopsided = [
        (d0["step"], sum(d0["backprop"]), sum(d1["backprop"]))
        for d0, d1 in zip(draws[0], draws[1])
        if (sum(d0["backprop"]) == 0) != (sum(d1["backprop"]) == 0)
    ]
    assert lopsided, "the seed drew no step where exactly one rank had an empty backpropagated group"


@pytest.mark.slow
@pytest.mark.parametrize("full_run, resumed_run", [("pruned", "resumed"), ("merged", "merged-resumed")],
                         ids=["unmerged", "merged"])
def test_resume_continues_the_mask_stream(engine_run, full_run, resumed_run):
    """Resumed from step 2's checkpoint, a run draws the masks of the uninterrupted one and ends on its weights;
    merged, each step's two micro-batches still run as one pass after the resume."""
    _, out = engine_run
    for rank in range(WORLD):
        full = {(d["step"], d["micro"]): d for d in report(out, full_run, rank)["draws"]}
        resumed = report(out, resumed_run, rank)["draws"]
        assert [d["step"] for d in resumed] == [2, 2, 3, 3]
        for d in resumed:
            assert d == full[(d["step"], d["micro"])], (rank, d["step"], d["micro"])  # same batch, same masks
        assert {d["pass"] for d in resumed} == ({2} if full_run == "merged" else {1})
        history = losses(report(out, resumed_run, rank)["log_history"])
        reference = {h["step"]: h["loss"] for h in losses(report(out, full_run, rank)["log_history"])}
        assert [h["step"] for h in history] == [1, 2, 3, 4]  # steps 1-2 come back from the checkpoint's state
        for h in history:
            assert h["loss"] == pytest.approx(reference[h["step"]], rel=1e-5)
    w_full, w_resumed = weights(out, full_run, 0), weights(out, resumed_run, 0)
    for key in w_full:
        torch.testing.assert_close(w_resumed[key], w_full[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("engine", [e for e in TESTED if e != "ddp"])
def test_every_engine_ends_where_ddp_ends(tmp_path_factory, engine):
    """Same data, same masks, sharded or not: every run ends on DDP's weights, up to float round-off."""
    ddp, other = launched("ddp", tmp_path_factory), launched(engine, tmp_path_factory)
    for run in runs_on(engine):
        w_ddp, w_other = weights(ddp, run["name"], 0), weights(other, run["name"], 0)
        assert w_ddp.keys() == w_other.keys()
        for key in w_ddp:
            torch.testing.assert_close(w_other[key], w_ddp[key], rtol=1e-4, atol=1e-5, msg=f"{run['name']}: {key}")


@pytest.mark.slow
def test_precomputed_reference_is_sharded_and_gathered_in_dataset_order(engine_run, tmp_path):
    """Each rank precomputes a shard of the batches; after the gather every rank stores what one process stores."""
    import importlib.util

    _, out = engine_run
    spec = importlib.util.spec_from_file_location("run_pruned", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    run = next(r for r in RUNS if r["name"] == "precompute")
    run = {**run, "config": {**run["config"], "ddp_backend": None}}  # this one process: no process group
    dataset = runner.Dataset.from_list(runner.preference_rows(16))
    single = runner.build(run, tmp_path, runner.char_tokenizer(), dataset).train_dataset[:]
    for rank in range(WORLD):
        stored = report(out, "precompute", rank)["stored_reference"]
        assert set(stored) == set(runner.STORED_REFERENCE)
        for column, values in stored.items():
            expected = single[column]
            assert len(values) == len(expected), column
            for got, want in zip(values, expected):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5, msg=column)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["auto", "auto-single"])
def test_auto_decides_alike_on_every_rank(engine_run, name):
    """auto's statistics are all-reduced: every rank measured the same noise and chose the same probabilities at the
    same steps, whatever its pairs; its first decision came within the first steps."""
    _, out = engine_run
    reports = [report(out, name, rank)["auto"] for rank in range(WORLD)]
    assert reports[0]["history"], reports[0]
    assert reports[0]["history"][0]["step"] <= 8
    for other in reports[1:]:
        assert other == reports[0]
    draws = [report(out, name, rank)["draws"] for rank in range(WORLD)]
    assert draws[0] != draws[1]  # the ranks held different pairs (or drew different masks)


@pytest.mark.slow
def test_auto_resume_reproduces_the_masks(engine_run):
    _, out = engine_run
    for rank in range(WORLD):
        full = {(d["step"], d["micro"]): d for d in report(out, "auto", rank)["draws"]}
        resumed = report(out, "auto-resumed", rank)["draws"]
        assert [d["step"] for d in resumed] == [4, 4, 5, 5, 6, 6, 7, 7]
        for d in resumed:
            assert d == full[(d["step"], d["micro"])], (rank, d["step"], d["micro"])
        assert report(out, "auto-resumed", rank)["auto"] == report(out, "auto", rank)["auto"]


# Two ranks holding different kinds of pairs (rank 0 near-copies, rank 1 dissimilar), `auto` on both families, no
# accumulation: the engine path, whose warm-up probes each family by step 7. One launch of its own (DDP only).
PER_RANK = {"name": "auto-per-rank", "data": "per-rank",
            "config": {**SAVINGS_OFF, "branch_keep_prob": "auto", "position_keep_prob": "auto", "max_steps": 8,
                       "prune_log_level": "debug"}}


@pytest.mark.slow
def test_every_prune_value_logged_is_the_runs(tmp_path):
    """Every `prune/*` value logged at every logged step is the run's, reduced across ranks as TRL reduces its own
    metrics (gather, then mean): identical on both ranks, and `auto`'s keep probabilities the mean of the ranks' own
    (equal pairs per rank) at the probe steps where the ranks drew with different ones."""
    if "ddp" not in TESTED:
        pytest.skip("DDP is not among TEST_DISTRIBUTED_ENGINES")
    launch("ddp", tmp_path, [PER_RANK])
    reports = [report(tmp_path, PER_RANK["name"], rank) for rank in range(WORLD)]
    logged = [losses(r["log_history"]) for r in reports]
    assert [h["step"] for h in logged[0]] == [h["step"] for h in logged[1]] == list(range(1, 9))
    for h0, h1 in zip(*logged):
        keys = {k for k in h0 if k.startswith("prune/")}
        assert keys == {k for k in h1 if k.startswith("prune/")} and "prune/branch_keep_prob" in keys
        assert {k: h0[k] for k in keys} == {k: h1[k] for k in keys}, h0["step"]
    differed = 0
    for step, (h0, h1) in enumerate(zip(*logged)):
        draws = [next(d for d in r["draws"] if d["step"] == step) for r in reports]
        for key in ("branch_keep_prob", "position_keep_prob"):
            own = [d[key] for d in draws]
            assert h0[f"prune/{key}"] == pytest.approx(sum(own) / WORLD, abs=1e-12), (step, key, own)
            differed += own[0] != own[1]
    assert differed, "no step where the ranks drew with different keep probabilities"
