"""What the tests of the pretrained built-ins share (test_real_model.py, test_gemma3.py): the built model's folder,
or a skip saying why the package registry cannot serve it; and the check that a failed build cached nothing."""

import pytest

from trl_pruned_dpo.demo import pretrained, resolve_model


def built_or_skip(model: str) -> str:
    """The cached folder of built-in `model` (built on first use); the test skips only if the registry is out of reach."""
    try:
        return resolve_model(model)
    except pretrained.RegistryUnreachable as error:
        pytest.skip(f"{model} cannot be built here: {error}")


@pytest.fixture()
def empty_cache(monkeypatch, tmp_path):
    """A fresh, empty cache folder for the build's error paths."""
    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def assert_nothing_cached(cache, model: str) -> None:
    """No folder of built-in `model` (``builtin:<name>``) under `cache`: a failed build leaves nothing behind."""
    models, name = cache / "models", model.removeprefix("builtin:")
    assert not models.exists() or not any(p.name.startswith(name) for p in models.iterdir())
