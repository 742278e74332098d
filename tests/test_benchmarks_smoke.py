"""The benchmark harness runs end to end in its tiniest mode and writes the fields the docs rely on.

No timing assertions: the numbers of a 2-layer, 64-wide model mean nothing. The `--workload` grid runs in its
tiniest mode and checks the exact settings against stock's loss; its length models are checked against the numbers
docs/benchmarks.md states. The FLOP model is checked against the
worked examples in docs (branch pruning at 0.5: 10 -> 7 forward-units with a live reference and checkpointing, 8 -> 5
with a precomputed reference, 8 -> 6 without checkpointing).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.flops import Shape, Work, step_flops  # noqa: E402
from tiny import run_module  # noqa: E402

EXPECTED = {
    "setting", "reference", "checkpointing", "stock_step_s", "pruned_step_s", "speedup", "flop_limit", "efficiency",
    "tokens_executed", "tokens_needed", "head_positions_vs_stock", "positions_scored", "branches_backpropagated",
    "stock_gflop", "pruned_gflop",
}


def _units(grad_rows_share: float, live: bool, ckpt: bool) -> float:
    """Forward-units of a step on 2 rows of 1 token, body only (a head of zero positions)."""
    shape = Shape(hidden=8, layers=1, intermediate=8, heads=1, kv_heads=1, head_dim=8, vocab=8)
    work = Work(
        policy_rows=2, policy_tokens=2.0, policy_positions=0.0, grad_rows=2 * grad_rows_share,
        grad_tokens=2.0 * grad_rows_share, grad_positions=0.0, reference_rows=2 if live else 0,
        reference_tokens=2.0 if live else 0.0,
    )
    return step_flops(shape, work, ckpt)["total"] / shape.body_per_token(1.0)


@pytest.mark.parametrize(
    "live, ckpt, stock, pruned", [(True, True, 10, 7), (False, True, 8, 5), (True, False, 8, 6)]
)
def test_flop_model_worked_examples(live, ckpt, stock, pruned):
    assert _units(1.0, live, ckpt) == pytest.approx(stock)
    assert _units(0.5, live, ckpt) == pytest.approx(pruned)


def test_smoke_run_writes_results(tmp_path):
    out = tmp_path / "bench"
    scratch = tmp_path / "tmp"  # the system temp directory of the run: it must be left empty
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "TMPDIR": str(scratch)}
    settings = ["none", "branch", "position", "prefix", "combined", "max", "share"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_time", "--smoke", "--out", str(out), "--settings", *settings],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "limit" in proc.stdout and "eff" in proc.stdout  # the table is printed

    assert not list(scratch.iterdir()), list(scratch.iterdir())  # no bench_* folders left behind
    data = json.loads((out / "step_time.json").read_text())
    assert {"machine", "settings", "mode"} <= set(data["meta"])
    # on CPU the defaults measure honestly on a shared machine: one thread, CPU-time clock
    assert data["meta"]["machine"]["torch_threads"] == 1 and data["meta"]["clock"] == "cpu"
    rows = data["results"]
    assert {r["setting"] for r in rows} == set(data["meta"]["settings"])
    for row in rows:
        assert EXPECTED <= set(row), EXPECTED - set(row)
        assert row["speedup"] > 0 and row["flop_limit"] > 0
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["flop_limit"])
    by_setting = {r["setting"]: r for r in rows}
    # what the settings must do to the counted work, whatever the timings
    assert by_setting["branch"]["branches_backpropagated"] == pytest.approx(0.5)
    assert by_setting["none"]["branches_backpropagated"] == pytest.approx(1.0)
    assert by_setting["position"]["positions_scored"] < 1.0
    assert by_setting["branch"]["flop_limit"] > by_setting["none"]["flop_limit"]
    assert by_setting["combined"]["memory_ratio"] > 0  # fresh-process memory measured
    assert by_setting["share"]["tokens_executed"] < by_setting["none"]["tokens_executed"]  # prompts ran once
    assert (out / "step_time.csv").read_text().startswith("kind,")
    pytest.importorskip("matplotlib")
    assert (out / "step_time.png").stat().st_size > 0


# What docs/benchmarks.md says the length models give at full scale (20k pairs): median row (prompt + chosen) and
# median prompt / median response.
DOCUMENTED_LENGTHS = {"ultrafeedback": (409, 0.42), "hh": (186, 2.15), "multiturn": (512, 3.0)}


@pytest.mark.parametrize("name", sorted(DOCUMENTED_LENGTHS))
def test_length_models_match_their_documentation(name):
    import random
    import statistics

    from benchmarks.workload import LENGTH_MODELS

    total, ratio = DOCUMENTED_LENGTHS[name]
    for scale in (1.0, 0.25):
        model = LENGTH_MODELS[name].scaled(scale)
        rng = random.Random(0)
        pairs = [model.sample(rng) for _ in range(20000)]
        prompt, chosen = [p[0] for p in pairs], [p[1] for p in pairs]
        assert statistics.median(p + c for p, c in zip(prompt, chosen)) == pytest.approx(total * scale, rel=0.03)
        assert statistics.median(prompt) / statistics.median(chosen) == pytest.approx(ratio, rel=0.03)
        assert max(p + max(c, r) for p, c, r, _ in pairs) <= model.max_total  # the long tail is truncated
        assert all(0 <= k < min(c, r) for _, c, r, k in pairs)  # each response keeps a token of its own
        if scale == 1.0:
            assert model.max_total == 1024 and statistics.mean(p[3] for p in pairs) == pytest.approx(1.0, abs=0.05)


def test_layout_tokens_counts_real_tokens_per_layout():
    import torch

    from benchmarks.workload import layout_tokens

    # 2 pairs, right-padded to 6: pair 0 shares 3 tokens (prompt 2 + 1 response token), pair 1 its 2-token prompt
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 0, 0, 0], [5, 6, 7, 4, 0, 0], [5, 6, 8, 9, 0, 0]])
    valid = (ids != 0).long()
    completion = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]])
    counts = layout_tokens(dict(input_ids=ids, attention_mask=valid, completion_mask=completion))
    assert counts["padded"] == 5 + 3 + 4 + 4  # every real token
    assert counts["rows"] == 5 + 3 + 4 + 4  # each row up to its last token
    assert counts["rows_packed"] == 4 + 2 + 3 + 3  # pre-shifted labels: the last token is only a label
    # per pair: s - 1 shared positions, then each branch's positions up to the one predicting its last token
    # pair 0: s = 3 -> 2 shared + (4 - 2) + (3 - 2); pair 1: s = 2 -> 1 shared + (2 - 1) + (3 - 1)
    assert counts["shared"] == (2 + 2 + 1) + (1 + 1 + 2)


def test_workload_smoke_run(tmp_path):
    """`--workload` end to end in its tiniest mode: stock and every exact-savings setting, side by side."""
    from benchmarks import report, step_time

    out = tmp_path / "bench"
    printed = run_module("benchmarks.step_time", "--smoke", "--workload", "hh", "--out", str(out))
    assert "padding" in printed and "dloss@1" in printed  # the table is printed
    data = json.loads((out / "step_time.json").read_text())
    rows = {r["setting"]: r for r in data["results"]}
    assert list(rows) == ["stock", *step_time.WORKLOAD_SETTINGS]
    assert rows["stock"]["padding_share"] > 0.05  # ragged lengths: stock pads every row to the longest
    for name in step_time.WORKLOAD_SETTINGS:
        row = rows[name]
        assert row["speedup_paired_median"] > 0 and row["tokens_per_s"] > 0 and row["batches_match"]
        assert row["padding_share"] is None or 0 <= row["padding_share"] < 1
        assert row["exact"] == (name != "exact+prefix0.5")
        if row["exact"]:  # identical weights and batch at step 1: the exact settings are stock's computation
            assert row["loss_diff_first"] <= report.EXACT_LOSS, row
            assert row["grad_norm_rel_diff_first"] <= report.EXACT_GRAD, row
    assert rows["exact"]["memory_ratio"] > 0  # fresh-process memory measured
    assert abs(rows["exact"]["stock_loss_first"] - 0.6931) > 1e-3  # the reference differs from the policy
    assert "### Targets" in report.render(data)


def test_a_fallback_is_reported_not_counted_as_a_saving():
    """A `padding_free` the trainer did not honour (TRL's padded forward ran, or padded rows) is named in `notes` and
    fails the report's "ran as configured" target; its padding is what ran."""
    from benchmarks import report, step_time

    shape = Shape(hidden=8, layers=1, intermediate=8, heads=1, kv_heads=1, head_dim=8, vocab=8)
    work = Work(policy_rows=2, policy_tokens=20.0, policy_positions=10.0, grad_rows=2, grad_tokens=20.0,
                grad_positions=10.0, response_positions=10.0)

    def step(layout, executed, real):
        return dict(measured=True, loss=0.7, grad_norm=1.0, batch=1, layout=layout, executed=executed, real=real,
                    data_tokens=real)

    runs = {"stock": [step("trl-padded", 20, 15)], "padding_free": [step("trl-padded", 20, 15)],
            "padding_free+share": [step("rows", 20, 15)], "exact": [step("shared", 12, 12)]}
    timed = dict(times={n: [1.0] for n in runs}, cpu_times={n: [1.0] for n in runs},
                 works={n: [work] for n in runs}, shape=shape, steps=runs)
    group = dict(workload=step_time.Workload(lengths="hh", name="hh"), precompute=False, checkpointing=True,
                 kind="workload")
    rows = {r["setting"]: r for r in step_time.summarize_workload(group, timed, {}, "cpu")}
    assert rows["stock"]["padding_share"] == pytest.approx(0.25)
    assert "padding_free ignored" in rows["padding_free"]["notes"]
    assert rows["padding_free"]["padding_share"] == pytest.approx(0.25)  # stock's padding, as it ran
    notes = rows["padding_free+share"]["notes"]
    assert "padding_free not honoured: 25.0% padding" in notes and "share_prompt did not share" in notes
    assert rows["exact"]["notes"] == "" and rows["exact"]["padding_share"] == 0.0
    checks = {name: ok for name, ok, _ in report.workload_targets(list(rows.values()))}
    assert checks["every setting ran as configured (no fallback)"] is False


def test_warns_when_the_machine_is_loaded(monkeypatch, capsys):
    from benchmarks import step_time

    monkeypatch.setattr(step_time.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(step_time.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    step_time.warn_if_loaded()
    assert "load average 5.0 exceeds the 2 cores" in capsys.readouterr().err
    monkeypatch.setattr(step_time.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    step_time.warn_if_loaded()
    assert capsys.readouterr().err == ""


def _chat_model_folder(tmp_path) -> str:
    """builtin:tiny-demo (a 2-layer Llama, character-level tokenizer) copied with a chat template: the `--model` path
    of a pretrained chat model, in seconds."""
    import shutil

    from transformers import AutoTokenizer

    from trl_pruned_dpo.demo import resolve_model

    folder = tmp_path / "tiny-chat"
    shutil.copytree(resolve_model("builtin:tiny-demo"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = (
        "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant: {% endif %}"
    )
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("chat", [True, False])
def test_text_rows_hit_the_length_model(tmp_path, chat):
    """`--model`'s pairs are real text at the length model's token counts as TRL tokenizes them (within a token or
    two: BPE merges at a window's edges), conversational when the tokenizer has a chat template."""
    import random

    from transformers import AutoTokenizer

    from benchmarks.workload import Workload, length_model, text_rows
    from trl_pruned_dpo.demo import resolve_model

    folder = _chat_model_folder(tmp_path) if chat else resolve_model("builtin:tiny-demo")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    w = Workload(lengths="hh", length_scale=0.5, batch_size=4, num_batches=2, model=folder)
    rows = text_rows(w, random.Random(0), tokenizer)
    assert len(rows["prompt"]) == 8
    texts = []
    for prompt, chosen, rejected in zip(rows["prompt"], rows["chosen"], rows["rejected"]):
        if chat:
            p = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
            c = tokenizer.apply_chat_template(prompt + chosen, return_dict=False)
            r = tokenizer.apply_chat_template(prompt + rejected, return_dict=False)
            texts += [prompt[0]["content"], chosen[0]["content"]]
        else:
            p = tokenizer(prompt)["input_ids"]
            c = tokenizer(prompt + chosen + tokenizer.eos_token)["input_ids"]
            r = tokenizer(prompt + rejected + tokenizer.eos_token)["input_ids"]
            texts += [prompt, chosen]
        assert c[:len(p)] == p and r[:len(p)] == p  # the prompt is a prefix: TRL's split is where we think
        assert c != r
    text = " ".join(texts)
    assert len(text.split()) > 50 and sum(ch.isalpha() for ch in text) > len(text) / 2  # English words, not ids
    lengths = [len(tokenizer(x if not chat else x[0]["content"])["input_ids"]) for x in rows["prompt"]]
    assert max(lengths) <= length_model("hh").scaled(0.5).max_prompt + 2


def test_model_smoke_run(tmp_path):
    """`--model` end to end in its tiniest mode: a local chat-model folder, real text, the issue's rows and columns."""
    from benchmarks import report, step_time

    out = tmp_path / "bench"
    printed = run_module("benchmarks.step_time", "--smoke", "--model", _chat_model_folder(tmp_path), "--workload", "hh",
                         "--out", str(out))
    assert "tok limit" in printed and "peak ratio" in printed
    data = json.loads((out / "step_time.json").read_text())
    rows = {r["setting"]: r for r in data["results"]}
    assert list(rows) == ["stock", *step_time.MODEL_SETTINGS]
    assert rows["stock"]["vocab"] == 99 and rows["stock"]["model"].endswith("tiny-chat")  # the folder's model
    for name in step_time.MODEL_SETTINGS:
        row = rows[name]
        assert row["tokens_executed_per_step"] > 0 and row["batches_match"]
        assert row["token_limit"] == pytest.approx(
            rows["stock"]["tokens_executed_per_step"] / row["tokens_executed_per_step"])
        if row["exact"]:  # shared weights at learning rate 0: every trainer's step 1 is on stock's weights
            assert row["loss_diff_first"] <= report.EXACT_LOSS, row
    assert rows["exact"]["token_limit"] > 1  # ragged real text: the exact preset runs fewer tokens than stock
    assert rows["exact"]["pruned_peak_mb"] > 0 and rows["exact"]["peak_ratio"] > 0  # fresh-process memory (smoke:
    assert rows["stock"]["pruned_peak_mb"] > 0  # stock and the exact preset only; the model preset measures all)


def test_memory_sweep_skips_and_bisects():
    """The sweep's logic on a fake server whose memory is 100 + L / 10 MiB (stock) or half of it (exact): points
    predicted over the budget are not run, and bisection closes in on the longest length that fits."""
    from benchmarks import memory

    class Fake:
        def __init__(self):
            self.runs = []

        def measure(self, spec):
            length = sum(int(x) for x in spec["workload"]["lengths"].split(":")[1].split("+"))
            self.runs.append((spec["side"], length))
            peak = 100 + length / 10 if spec["side"] == "stock" else 50 + length / 20
            if peak > spec["cap_mb"]:
                return {"ok": False, "over_cap": True, "stopped_at_mb": 1000 + peak, "rss_start_mb": 1000}
            return {"ok": True, "peak_mb": 1000 + peak, "rss_start_mb": 1000, "working_mb": peak / 2, "build_mb": 1,
                    "cpu_s": 0.1, "params_mb": 10, "trainable_mb": 10}

    server = Fake()
    rows = memory.sweep(server, model="", lengths=[512, 1024, 2048, 4096], budget_mb=260, pairs=8, bisect=3,
                        log=lambda _: None)
    longest = {r["side"]: r for r in rows if r["phase"] == "longest"}
    # stock: 151, 202 fit; 2048 predicted at 304 > 260: not run, nor 4096; longest fit 1600 -> bisect from 1024
    assert ("stock", 2048) not in server.runs and ("stock", 4096) not in server.runs
    assert longest["stock"]["longest_fit"] >= 1024 and longest["stock"]["shortest_over"] <= 2048
    assert longest["exact"]["longest_fit"] >= 2048  # 50 + 4096 / 20 = 255 fits
    assert "over (predicted" in memory.length_table(rows)


@pytest.mark.parametrize("shape,lora", [("uniform", []), ("ultrafeedback", ["--lora", "4"])])
def test_memory_length_smoke_run(tmp_path, shape, lora):
    """`python -m benchmarks.memory` end to end at tiny lengths (uniform rows, and ragged rows truncated at L, there
    with a LoRA adapter): a measured point per side, the table and the plot."""
    lengths = ["32", "64"] if shape == "uniform" else ["32"]  # one point per side is enough for the ragged rows
    # Each point is measured in the benchmark's own worker process; the sweep around them runs here.
    printed = run_module("benchmarks.memory", "--lengths", *lengths, "--pairs", "1", "--bisect", "0", "--shape", shape,
                         *lora, "--out", str(tmp_path))
    data = json.loads((tmp_path / "memory_length.json").read_text())
    assert data["meta"]["lora_r"] == (4 if lora else 0)
    trained = {r["trainable_mb"] / r["params_mb"] for r in data["results"] if "peak_mb" in r}
    assert all(share < 0.2 for share in trained) if lora else trained == {1.0}  # the adapter alone, or every weight
    measured = [r for r in data["results"] if "peak_mb" in r]
    assert {r["side"] for r in measured} == {"stock", "exact"} and all(r["peak_mb"] > 0 for r in measured)
    assert "| 32 |" in printed and "Longest length" in printed
    pytest.importorskip("matplotlib")
    assert (tmp_path / "memory_length.png").stat().st_size > 0


def test_memory_breakdown_smoke_run():
    """`python -m benchmarks.memory_breakdown` at a tiny scale: both sides profiled, the peak attributed by region."""
    printed = run_module("benchmarks.memory_breakdown", "--workload", "hh", "--scale", "0.05", "--top", "3")
    assert printed.count("peak of the step's live allocations") == 2, printed[-3000:]
    assert printed.count("at the peak, by region:") == 2


# Rows whose code other rows of the dry run already run (the 8 x 1 comparators, `position`, the bisection's stock side,
# CUDA graphs: the same eager backend as `compile` on CPU), left out to keep CI short.
LEFT_OUT_OF_CI = r"^(?!extra/0\.5B UF/(stock|defaults|exact|position)$|extra/0\.5B UF max/stock$|compile/best/cudagraphs$)"


def test_gpu_check_dry_run(tmp_path):
    """`benchmarks/gpu_check.py --dry-run`: the row kinds of the GPU check (stock, the noise floor, defaults with the
    merged step, merging off, the exact preset, each estimator, prompt groups, issue 48's fp16 and QLoRA-shaped cells,
    torch.compile on the best row, the largest-micro-batch bisection) on a tiny CPU model, none failed or skipped
    (LEFT_OUT_OF_CI: rows whose code others here run); the
    exact rows agree with stock (fp32, same batch and weights); the merged step runs fewer packed attention calls
    than merging off; the table and both result files written (what `bash benchmarks/gpu_check.sh` runs on a
    device). Then the profiler counts the dry run cannot reach (CUDA events) on synthetic events."""
    from benchmarks import gpu_check

    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--warmup", "1", "--steps", "1", "--budget", "3000",
         "--rows", LEFT_OUT_OF_CI, "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "ERROR" not in proc.stdout and "SKIPPED" not in proc.stdout, proc.stdout[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = data["results"]
    assert rows and not [r for r in rows if r["status"] != "ok"], [r for r in rows if r["status"] != "ok"]
    assert {r["row"] for r in rows} == set(gpu_check.ROW_KINDS) - {"cudagraphs", "position"}
    cells = {r["cell"] for r in rows}
    assert {"0.5B UF 8x4", "0.5B UF k4-all 12x4", "0.5B UF fp16", "0.5B LoRA8 UF qlora-norms", "0.5B UF",
            "0.5B UF max"} <= cells, cells
    for r in rows:
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0, r
        if r["exact"] and r["row"] != "stock" and "max_pairs" not in r and r["row"] not in gpu_check.COMPILE_MODES:
            assert r["loss_diff"] < 1e-4 and r["grad_cos"] > 0.9999 and abs(r["grad_norm_ratio"] - 1) < 1e-3, r
        if "max_pairs" in r:  # the stand-in cap of a dry run
            assert r["max_pairs"] == gpu_check.DRY_CAP_PAIRS and not r["bound_only"], r
        else:  # profiled: the step ranges found, CPU ops counted, no CUDA event on CPU
            assert r["profiled_steps_found"] == 1 and r["cpu_ops"] > 0 and r["launches"] == 0, r
            if r["side"] == "pruned":  # the kernel of each packed attention call (SDPA per segment on CPU)
                assert set(r["attention_kernels"]) == {"sdpa_per_segment float32"}, r
    by = {(r["cell"], r["row"]): r for r in rows}
    merged, unmerged = (sum(by[("0.5B UF 8x4", k)]["attention_kernels"].values()) for k in ("defaults", "merge_off"))
    assert merged < unmerged, (merged, unmerged)  # 4 micro-batches in fewer packed passes
    assert {r["accum"] for r in rows} == {1, 2, 4}
    compiled = next(r for r in rows if r["row"] == "compile")
    assert compiled["compiled_layers"] > 0 and compiled["compiled_row"] in gpu_check.ROWS, compiled
    for key in ("torch", "transformers", "trl", "git", "date"):
        assert data["meta"][key], key
    table = (tmp_path / "gpu_check.txt").read_text()
    for column in ("step s", "tok/s", "GPU s", "busy%", "launches", "syncs", "peak GiB", "kernel", "grad cos",
                   "floor cos", "n/a"):
        assert column in table, column

    from types import SimpleNamespace as Event

    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA

    def event(name, device, start, end, kind):
        return Event(name=name, device_type=device, time_range=Event(start=start, end=end), activity_type=kind)

    events = [  # two steps (0-100, 200-300 us); kernels overlapping over 20-30 us
        event(gpu_check.STEP_MARK, cpu, 0, 100, "user_annotation"),
        event(gpu_check.STEP_MARK, cpu, 200, 300, "user_annotation"),
        event(gpu_check.STEP_MARK, cuda, 0, 110, "gpu_user_annotation"),
        event("cudaLaunchKernel", cpu, 2, 3, "cuda_runtime"), event("cuLaunchKernelEx", cpu, 210, 211, "cuda_driver"),
        event("cudaLaunchKernelExC", cpu, 212, 213, "cuda_runtime"),
        event("cudaMemcpyAsync", cpu, 20, 21, "cuda_runtime"),
        event("cudaStreamSynchronize", cpu, 21, 25, "cuda_runtime"),  # a .item(): one synchronisation
        event("cudaDeviceSynchronize", cpu, 150, 160, "cuda_runtime"),  # between the steps: not counted
        event("cudaMemcpy", cpu, 250, 251, "cuda_runtime"),  # synchronous: counted
        event("gemm", cuda, 10, 30, "kernel"), event("elementwise", cuda, 20, 40, "kernel"),
        event("Memcpy DtoH (Device -> Pageable)", cuda, 41, 42, "gpu_memcpy"), event("flash", cuda, 220, 230, "kernel"),
    ]
    for typed in (True, False):  # by activity type, and by name where torch gives none
        if not typed:
            for e in events:
                e.activity_type = None
        counts = gpu_check.count_events(events, 2)
        assert counts["launches"] == 1.5 and counts["syncs"] == 1.0 and counts["dtoh_copies"] == 0.5, counts
        assert counts["gpu_busy_s"] == pytest.approx(20e-6) and counts["gpu_kernel_sum_s"] == pytest.approx(25e-6)


def test_collectives_are_counted_by_kind_origin_and_bytes(monkeypatch, tmp_path):
    """benchmarks/collectives.py's counting, on a one-process gloo group (its two-process launch is run by hand: about
    a minute): each torch.distributed collective counted by kind with the bytes of its first tensor argument,
    positional or keyword (DeepSpeed's `output_tensor=`), as "trainer" inside accelerate's gather/reduce and "engine"
    elsewhere."""
    import collections

    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    from benchmarks.collectives import count_collectives

    # count_collectives wraps these in place: each restored after the test
    for name in ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce_scatter_tensor",
                 "all_gather_object", "all_gather_single", "reduce_scatter_single", "reduce_scatter",
                 "_all_gather_base", "_reduce_scatter_base"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, getattr(dist, name))
    # a stand-in for accelerate's gather: one all-reduce, so its collective's origin is "trainer"
    monkeypatch.setattr(Accelerator, "gather", lambda self, t: (dist.all_reduce(t), t)[1])
    monkeypatch.setattr(Accelerator, "reduce", Accelerator.reduce)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        counts = collections.defaultdict(lambda: [0, 0])
        count_collectives(counts)
        values = torch.ones(10)  # 40 bytes
        dist.all_reduce(values)
        dist.all_gather_into_tensor(output_tensor=torch.empty(10), input_tensor=values)
        dist.broadcast(torch.ones(3, dtype=torch.float64), src=0)
        Accelerator.gather(None, torch.ones(4))
    finally:
        dist.destroy_process_group()
    assert dict(counts) == {("all_reduce", "engine"): [1, 40], ("all_gather", "engine"): [1, 40],
                            ("broadcast", "engine"): [1, 24], ("all_reduce", "trainer"): [1, 16]}
