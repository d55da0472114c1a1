"""Model identity for the fingerprint: commit hash, else a digest of config + weights."""

import json

import torch

from hybridkv import identity
from hybridkv.engine.models import build_builtin, weights_digest
from hybridkv.identity import checkpoint_revision


def _checkpoint(directory, weights=b"w" * 1000, config=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or {"model_type": "x"}))
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "tokenizer.json").write_text("{}")
    return directory


def test_revision_follows_weights_and_config_not_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    a = checkpoint_revision(_checkpoint(tmp_path / "a" / "ckpt"))
    same = checkpoint_revision(_checkpoint(tmp_path / "elsewhere"))
    other_weights = checkpoint_revision(_checkpoint(tmp_path / "b" / "ckpt", weights=b"v" * 1000))
    other_config = checkpoint_revision(_checkpoint(tmp_path / "c" / "ckpt", config={"model_type": "y"}))
    assert a == same and a.startswith("sha256:")
    assert len({a, other_weights, other_config}) == 3
    (tmp_path / "elsewhere" / "tokenizer.json").write_text('{"changed": 1}')   # not identity
    assert checkpoint_revision(tmp_path / "elsewhere") == a


def test_digests_are_remembered_and_invalidated_by_a_rewrite(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ckpt = _checkpoint(tmp_path / "ckpt")
    first = checkpoint_revision(ckpt)
    memo = json.loads((tmp_path / "xdg" / "hybridkv" / "file-digests.json").read_text())
    assert str((ckpt / "model.safetensors").resolve()) in memo
    hashed = []
    real = identity.DigestMemo.digest

    def counting(self, f):
        if self.get(f) is None:
            hashed.append(f.name)
        return real(self, f)

    monkeypatch.setattr(identity.DigestMemo, "digest", counting)
    assert checkpoint_revision(ckpt) == first and hashed == []            # all from the memo
    (ckpt / "model.safetensors").write_bytes(b"z" * 999)                  # new size and mtime
    assert checkpoint_revision(ckpt) != first and hashed == ["model.safetensors"]


def test_unwritable_memo_only_costs_time(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    ckpt = _checkpoint(tmp_path / "ckpt")
    assert checkpoint_revision(ckpt) == checkpoint_revision(ckpt)


def test_hub_snapshot_is_named_by_its_commit(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    ckpt = _checkpoint(tmp_path / "models--org--m" / "snapshots" / commit)
    assert checkpoint_revision(ckpt) == commit


def test_weights_digest_sees_one_changed_value():
    model = build_builtin("tiny-hybrid")
    before = weights_digest(model)
    assert weights_digest(build_builtin("tiny-hybrid")) == before          # seeded: same weights
    with torch.no_grad():
        next(model.parameters()).view(-1)[7] += 1
    assert weights_digest(model) != before
