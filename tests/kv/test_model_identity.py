"""A model's weights name its namespaces: new weights under the same name are another
namespace, the same weights the same one, and a restart does not read them again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from persisting.kv.namespace import identity
from persisting.kv.namespace.identity import model_identity


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def write_model(directory: Path, weights: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"hidden_size": 64}')
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "README.md").write_text("about this model")
    return directory


def test_same_weights_same_identity_other_weights_another(tmp_path):
    a = write_model(tmp_path / "a", b"\x01" * 4096)
    b = write_model(tmp_path / "b", b"\x01" * 4096)
    first = model_identity(str(a))
    assert first["weights"].startswith("files:")
    assert model_identity(str(b)) == first  # where the files are does not matter
    write_model(a, b"\x02" * 4096)  # rebuilt in place: same name, same size
    assert model_identity(str(a)) != first


def test_a_rewrite_that_keeps_size_and_mtime_is_still_seen(tmp_path):
    model = write_model(tmp_path / "m", b"\x01" * 4096)
    before = model_identity(str(model))
    weights = model / "model.safetensors"
    stamp = weights.stat()
    weights.write_bytes(b"\x03" * 4096)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # as `cp -p` would
    assert model_identity(str(model)) != before


def test_docs_do_not_change_the_identity_but_config_does(tmp_path):
    model = write_model(tmp_path / "m", b"\x01" * 4096)
    before = model_identity(str(model))
    (model / "README.md").write_text("edited")
    (model / "LICENSE").write_text("terms")
    assert model_identity(str(model)) == before
    (model / "config.json").write_text('{"hidden_size": 64, "rope_theta": 1e6}')
    assert model_identity(str(model)) != before


def test_a_restart_does_not_hash_the_weights_again(tmp_path, monkeypatch):
    model = write_model(tmp_path / "m", b"\x05" * (1 << 20))
    first = model_identity(str(model))
    opened: list[str] = []
    real_open = open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    assert model_identity(str(model)) == first
    assert not any(p.endswith(".safetensors") for p in opened)


def test_a_pinned_version_wins_and_a_revision_is_kept(tmp_path):
    model = write_model(tmp_path / "m", b"\x01" * 16)
    assert model_identity(str(model), version="v2") == {"weights": "version:v2"}
    assert model_identity(str(model), revision="abc", version="v2") == {
        "revision": "abc",
        "weights": "version:v2",
    }


def test_an_unknown_model_is_unverified_and_says_so(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_identity("nobody/no-such-model") == {"weights": "unverified"}
    assert model_identity(str(tmp_path / "missing")) == {"weights": "unverified"}
    assert "model_version" in caplog.text


def test_a_hub_snapshot_is_named_by_its_blobs(tmp_path, monkeypatch):
    """A model id found in the Hugging Face cache: its files are links to blobs; a new
    revision with other weights is another model, the old revision still the old one."""
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    repo = hub / "models--org--tiny"

    def snapshot(revision: str, blob: str) -> None:
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        (repo / "blobs" / blob).write_bytes(f"weights {blob}".encode())
        (repo / "blobs" / ("c" * 64)).write_text("{}")
        snap = repo / "snapshots" / revision
        snap.mkdir(parents=True)
        (snap / "model.safetensors").symlink_to(f"../../blobs/{blob}")
        (snap / "config.json").symlink_to(f"../../blobs/{'c' * 64}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)

    snapshot("1" * 40, "a" * 64)
    first = model_identity("org/tiny")
    assert first["weights"].startswith("files:")
    snapshot("2" * 40, "b" * 64)  # a new revision on the hub, now the cached main
    assert model_identity("org/tiny") != first
    assert model_identity("org/tiny", revision="1" * 40)["weights"] == first["weights"]


def test_fingerprints_cache_is_private(tmp_path):
    model_identity(str(write_model(tmp_path / "m", b"\x01" * 16)))
    cache = tmp_path / "cache" / "persisting" / "model-fingerprints.json"
    assert cache.stat().st_mode & 0o077 == 0
    assert identity.fingerprint_directory(tmp_path / "m")


def test_weights_namespace_follows_the_weights(tmp_path, monkeypatch):
    """Where a served model's KV goes: its own name while the weights are unknown, a name
    per weights version once they are known (files found, or a pinned version)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    from persisting.kv.namespace.identity import weights_namespace

    assert weights_namespace("org/unknown") == ("org/unknown", {"weights": "unverified"})
    pinned, fields = weights_namespace("org/unknown", version="2026-12")
    assert pinned.startswith("org/unknown#") and fields == {"weights": "version:2026-12"}
    assert weights_namespace("org/unknown", version="2027-01")[0] != pinned
    model = write_model(tmp_path / "m", b"\x01" * 64)
    first, _ = weights_namespace(str(model))
    write_model(model, b"\x02" * 64)
    assert weights_namespace(str(model))[0] not in (first, str(model))


def hub_snapshot(hub: Path, files: dict[str, bytes]) -> Path:
    """A Hugging Face cache snapshot of ``org/tiny``: each file a link to a blob named by
    the sha256 of its content, as the hub client lays them out."""
    import hashlib

    repo = hub / "models--org--tiny"
    snap = repo / "snapshots" / ("1" * 40)
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{blob}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("1" * 40)
    return snap


def test_a_config_edited_through_the_snapshot_link_is_another_model(tmp_path, monkeypatch):
    """``PretrainedConfig.to_json_file`` writes through the snapshot's link into the blob:
    the blob keeps its name and (rope_theta 10000 -> 50000) its size, not its content."""
    from transformers import PretrainedConfig

    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    config = PretrainedConfig(rope_theta=10000, hidden_size=64)
    text = config.to_json_string().encode()
    snap = hub_snapshot(hub, {"config.json": text, "model.safetensors": b"\x01" * 4096})
    before = model_identity("org/tiny")
    blob = (snap / "config.json").resolve()
    size = blob.stat().st_size
    PretrainedConfig(rope_theta=50000, hidden_size=64).to_json_file(snap / "config.json")
    assert (snap / "config.json").is_symlink() and blob.stat().st_size == size
    assert model_identity("org/tiny") != before


def test_a_large_blob_rewritten_in_place_is_another_model(tmp_path, monkeypatch):
    """A weights blob over the content-hash size is named by its blob name and sampled
    slices: a fine-tune saved through the link (same shapes, so same size) is seen."""
    monkeypatch.setattr(identity, "_CONTENT_BYTES", 1 << 20)
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    snap = hub_snapshot(hub, {"config.json": b"{}", "model.safetensors": b"\x01" * (4 << 20)})
    before = model_identity("org/tiny")
    assert model_identity("org/tiny") == before
    (snap / "model.safetensors").write_bytes(b"\x02" * (4 << 20))  # through the link
    assert model_identity("org/tiny") != before


def test_weights_under_a_linked_subdirectory_are_in_the_fingerprint(tmp_path):
    shards = tmp_path / "elsewhere" / "shards"
    shards.mkdir(parents=True)
    (shards / "model-00001.safetensors").write_bytes(b"\x01" * 4096)
    model = write_model(tmp_path / "m", b"\x01" * 16)
    (model / "weights").symlink_to(shards, target_is_directory=True)
    before = model_identity(str(model))
    (shards / "model-00001.safetensors").write_bytes(b"\x02" * 4096)
    assert model_identity(str(model)) != before


def test_a_link_loop_is_walked_once_and_a_deep_tree_is_refused(tmp_path, monkeypatch):
    from persisting.errors import ConfigError

    model = write_model(tmp_path / "m", b"\x01" * 16)
    before = model_identity(str(model))
    (model / "sub").mkdir()
    (model / "sub" / "up").symlink_to(model, target_is_directory=True)  # a loop
    (model / "self").symlink_to(".", target_is_directory=True)
    assert model_identity(str(model)) == before  # nothing new below the loop
    monkeypatch.setattr(identity, "_MAX_DEPTH", 3)
    deep = model / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    (deep / "extra.safetensors").write_bytes(b"\x01")
    with pytest.raises(ConfigError, match="model_version"):
        model_identity(str(model))
    monkeypatch.setattr(identity, "_MAX_DEPTH", 16)
    monkeypatch.setattr(identity, "_MAX_FILES", 2)
    with pytest.raises(ConfigError, match="more than 2 files"):
        model_identity(str(model))
