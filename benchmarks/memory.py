"""Peak working memory of one trainer, each measured in a fresh process.

`MemoryServer` starts one helper process that imports torch/TRL once and then forks a child per measurement (a fresh
address space every time, without paying the imports again; the helper itself never runs a torch op, so the child
starts with clean thread pools and, on GPU, an uninitialised CUDA context). The child builds the trainer, runs the
warm-up steps (which allocate the optimizer state), then measures the training steps:

- CPU: RSS after warm-up is the baseline (weights, reference, optimizer state, runtime); the peak is VmHWM over the
  measured steps (reset through /proc/self/clear_refs); working memory = peak - baseline. The helper runs with a fixed
  glibc mmap threshold, so freed tensors go back to the OS and RSS tracks the live tensors instead of malloc's cache.
- CUDA: `torch.cuda.memory_allocated()` after warm-up is the baseline, `torch.cuda.max_memory_allocated()` the peak.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import subprocess
import sys

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def _trim():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def measure(spec: dict) -> dict:
    """Build the trainer described by `spec` and return its baseline and peak memory (MiB)."""
    import torch

    from benchmarks.workload import StepRunner, Workload, build_model, build_trainer, quiet

    quiet()
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    w = Workload(**spec["workload"])
    device = spec.get("device", "cpu")
    dtype = torch.bfloat16 if spec.get("bf16") else torch.float32
    rss_start = _status_kb("VmRSS") / 1024 if device == "cpu" else 0.0
    trainer = build_trainer(
        spec["side"], w, build_model(w, dtype),
        precompute=spec["precompute"], checkpointing=spec["checkpointing"], pruning=spec.get("pruning"),
        device=device, bf16=spec.get("bf16", False),
    )
    runner = StepRunner(trainer)
    for _ in range(spec.get("warmup", 1)):
        runner.step()
    peaks = []
    if device == "cpu":
        _trim()
        baseline = _status_kb("VmRSS") / 1024
        for _ in range(spec.get("steps", 2)):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            runner.step()
            peaks.append(_status_kb("VmHWM") / 1024)
            _trim()
    else:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated() / 2**20
        for _ in range(spec.get("steps", 2)):
            torch.cuda.reset_peak_memory_stats()
            runner.step()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / 2**20)
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / 2**20
    return {
        "baseline_mb": baseline,
        "build_mb": baseline - rss_start if device == "cpu" else baseline,
        "peak_mb": max(peaks),
        "working_mb": max(peaks) - baseline,
        "working_mb_steps": [p - baseline for p in peaks],
        "params_mb": params,
    }


def _serve():
    """Helper process: read one JSON spec per line, fork a child to measure it, write one JSON result per line."""
    import torch  # noqa: F401  (imports paid once, before forking)
    import trl  # noqa: F401
    import transformers  # noqa: F401
    import datasets  # noqa: F401

    try:
        import trl_pruned_dpo  # noqa: F401
    except ImportError:
        pass
    from benchmarks.workload import quiet, scratch_root

    quiet()
    scratch_root()  # created here, so the children (which exit without cleanup) write inside what this one removes
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the libraries print must not corrupt the protocol
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: measure, report, exit without running the parent's cleanup
            os.close(read_fd)
            try:
                result = {"ok": True, **measure(spec)}
            except Exception as e:  # reported to the caller, which decides
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            os.write(write_fd, json.dumps(result).encode())
            os.close(write_fd)
            os._exit(0)
        os.close(write_fd)
        chunks = []
        while chunk := os.read(read_fd, 65536):
            chunks.append(chunk)
        os.close(read_fd)
        os.waitpid(pid, 0)
        out.write((b"".join(chunks).decode() or json.dumps({"ok": False, "error": "child died"})) + "\n")
        out.flush()


class MemoryServer:
    """Client side of the helper process (a context manager)."""

    def __init__(self):
        env = {**os.environ, **MALLOC_ENV}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.memory"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=root,
        )

    def measure(self, spec: dict) -> dict:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("memory helper exited")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    _serve()
