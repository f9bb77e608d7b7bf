import hashlib
import json

import pytest

from specexport.bundle import MANIFEST, SCHEMA_VERSION, Bundle, load_bundle, sha256_file, write_manifest
from specexport.bundle import staged_bundle as staged_output
from specexport.errors import UserError


def make_bundle(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "decoder.onnx").write_bytes(b"graph bytes")
    (folder / "decoder.onnx.data").write_bytes(b"\0" * 3000)
    (folder / "tokenizer").mkdir(exist_ok=True)
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    return write_manifest(folder, {"model": {"name": "tiny", "vocab": 16}, "method": {"name": "none"}, "precision": "int8",
                                   "flavour": "ort", "max_context": 64, "graphs": {"target": {"file": "decoder.onnx"}},
                                   "tokenizer": {"files": ["tokenizer/tokenizer.json"]}})


def edit_manifest(folder, **changes):
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.update(changes)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_sha256_file_streams_whole_file(tmp_path):
    data = bytes(range(256)) * 9000  # more than one 1 MiB chunk
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_round_trip(tmp_path):
    written = make_bundle(tmp_path / "b")
    assert written["schema_version"] == SCHEMA_VERSION
    assert sorted(written["files"]) == ["decoder.onnx", "decoder.onnx.data", "tokenizer/tokenizer.json"]
    assert written["files"]["decoder.onnx.data"]["bytes"] == 3000

    bundle = load_bundle(tmp_path / "b")
    assert isinstance(bundle, Bundle)
    assert bundle.manifest == written
    assert (bundle.method, bundle.precision) == ("none", "int8")
    assert bundle.graphs == {"target": {"file": "decoder.onnx"}}
    assert bundle.file("decoder.onnx").read_bytes() == b"graph bytes"


def test_file_may_not_leave_the_bundle(tmp_path):
    make_bundle(tmp_path / "b")
    with pytest.raises(UserError, match="outside the bundle"):
        load_bundle(tmp_path / "b").file("../secret")


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_bundle(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is not a folder"):
        load_bundle(tmp_path / "f")


def test_no_manifest(tmp_path):
    with pytest.raises(UserError, match="not a specexport bundle"):
        load_bundle(tmp_path)


def test_manifest_not_json(tmp_path):
    (tmp_path / MANIFEST).write_text("{ not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_bundle(tmp_path)


def test_unknown_schema_version(tmp_path):
    make_bundle(tmp_path)
    edit_manifest(tmp_path, schema_version=99)
    with pytest.raises(UserError, match=f"schema_version 99; this specexport reads version {SCHEMA_VERSION}"):
        load_bundle(tmp_path)


def test_missing_graph(tmp_path):
    make_bundle(tmp_path)
    (tmp_path / "decoder.onnx").unlink()
    with pytest.raises(UserError, match="is incomplete: graph decoder.onnx missing"):
        load_bundle(tmp_path, verify=False)


def test_size_change_caught_without_hashing(tmp_path):
    make_bundle(tmp_path)
    (tmp_path / "decoder.onnx.data").write_bytes(b"\0" * 10)
    with pytest.raises(UserError, match=r"decoder.onnx.data changed since export \(10 bytes, expected 3000\)"):
        load_bundle(tmp_path, verify=False)


def test_checksum_mismatch(tmp_path):
    make_bundle(tmp_path)
    (tmp_path / "decoder.onnx").write_bytes(b"graph BYTES")  # same size
    with pytest.raises(UserError, match=r"file decoder.onnx changed since export \(sha256 mismatch\)"):
        load_bundle(tmp_path)
    assert load_bundle(tmp_path, verify=False).method == "none"


def test_errors_are_one_line(tmp_path):
    (tmp_path / MANIFEST).write_text("{\n\n bad")
    with pytest.raises(UserError) as info:
        load_bundle(tmp_path)
    assert "\n" not in str(info.value)


def test_staged_output_success(tmp_path):
    dest = tmp_path / "out" / "bundle"  # parent is created
    with staged_output(dest) as work:
        assert work.parent == dest.parent and work.name.startswith(".bundle.partial-")
        assert not dest.exists()
        make_bundle(work)
    assert load_bundle(dest).method == "none"
    assert [p.name for p in dest.parent.iterdir()] == ["bundle"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_staged_output_cleans_up(tmp_path, error):
    dest = tmp_path / "bundle"
    make_bundle(dest)
    before = (dest / MANIFEST).read_text()
    with pytest.raises(error):
        with staged_output(dest, overwrite=True) as work:
            (work / "half.onnx").write_bytes(b"half")
            raise error()
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]
    assert (dest / MANIFEST).read_text() == before


def test_staged_output_removes_the_folders_it_made(tmp_path):
    with pytest.raises(RuntimeError):
        with staged_output(tmp_path / "a" / "b" / "bundle"):
            raise RuntimeError()
    assert list(tmp_path.iterdir()) == []


def test_staged_output_refuses_existing_before_any_work(tmp_path):
    dest = tmp_path / "bundle"
    dest.mkdir()
    entered = False
    with pytest.raises(UserError, match="already exists"):
        with staged_output(dest):
            entered = True
    assert not entered
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def test_staged_output_overwrite_replaces(tmp_path):
    dest = tmp_path / "bundle"
    make_bundle(dest)
    (dest / "stale.onnx").write_bytes(b"old")
    with staged_output(dest, overwrite=True) as work:
        (work / "new.onnx").write_bytes(b"new")
    assert sorted(p.name for p in dest.iterdir()) == ["new.onnx"]
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]
