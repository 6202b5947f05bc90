"""Datasets in the bucket (trainproof.data, trainproof.storage.objects), in process: packing and reading back every kind on every
backend, the identity, what a hostile or damaged bucket gets (a refused manifest, a flipped byte or a missing shard
named in one line, exit 1 through ``trainproof data``), the part cache's bound, and a forked reader.

The trainer's use of these datasets with DataLoader workers is tests/test_data_workers.py; S3 over loopback is
tests/test_data_s3.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from trainproof.data import DATASET_FILE, ShardedDataset, cache_settings, pack_records, pack_samples, token_windows
from trainproof.data import manifest as dm
from trainproof.errors import ConfigError, DataError
from trainproof.storage import open_store
from trainproof.storage.objects import CorruptObjectError, ObjectReader, PartCache, parse_entry
from tests.support.timing import budget
from tests.test_verify_helpers import cli  # noqa: F401  (fixture)

SMALL = {"shard_bytes": 16 * 1024, "part_bytes": 4096}


@pytest.fixture(params=["memory", "local"])
def url(request, tmp_path):
    return f"memory://ds-{uuid.uuid4().hex[:10]}/data" if request.param == "memory" else str(tmp_path / "data")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("TRAINPROOF_DATA_CACHE", str(folder))
    return folder


def tokens(n: int = 20_000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.uint16)


def shard_path(root: Path, packed, k: int) -> Path:
    return root / packed.manifest.shards[k].entry.name


# -- round trips ---------------------------------------------------------------------------------------------
def test_records_round_trip_shard_by_shard_and_part_by_part(url, cache):
    windows = token_windows(tokens(), 32)  # 624 windows of 33 tokens: 66 bytes each, 248 a shard of 16 KiB
    packed = pack_records(url, windows, **SMALL)
    assert len(packed.manifest.shards) == 3 and packed.manifest.samples == len(windows)
    data = ShardedDataset(url)
    assert len(data) == len(windows) and data.data_identity == packed.identity
    ids = [0, 1, 247, 248, 249, 400, len(windows) - 1]  # shard edges, a record across a part edge, the end
    got = data.__getitems__(ids)
    for i, sample in zip(ids, got):
        assert sample.dtype == np.dtype("<u2") and sample.shape == (33,) and (sample == windows[i]).all()
        assert sample.flags.writeable  # torch.from_numpy warns on read-only arrays
    assert (data[5] == windows[5]).all() and data.lengths([0, 9]) == [33, 33]
    with pytest.raises(IndexError):
        data[len(windows)]


def test_samples_of_any_size_round_trip_through_their_index(url, cache):
    rng = np.random.default_rng(1)
    samples = [rng.integers(0, 1000, int(n), dtype=np.int32) for n in rng.integers(1, 3000, 60)]
    samples.append(np.arange(7000, dtype=np.int32))  # larger than a shard: a shard of its own
    packed = pack_samples(url, samples, dtype="<i4", **SMALL)
    data = ShardedDataset(url)
    assert data.manifest.kind == "samples" and len(data) == len(samples) and len(packed.manifest.shards) > 3
    order = list(range(len(samples)))[::-7]
    for i, got in zip(order, data.__getitems__(order)):
        assert got.dtype == np.dtype("<i4") and (got == samples[i]).all()
    assert data.lengths([0, len(samples) - 1]) == [len(samples[0]), 7000]
    raw = pack_samples(f"{url}-bytes", [b"abc", b"", b"\x00\xff"], **SMALL)
    assert [bytes(s) for s in ShardedDataset(raw.url).__getitems__([0, 1, 2])] == [b"abc", b"", b"\x00\xff"]


def test_identity_is_the_data_not_where_or_when_it_was_packed(tmp_path, cache):
    windows = token_windows(tokens(), 32)
    first = pack_records(str(tmp_path / "a"), windows, **SMALL)
    again = pack_records(str(tmp_path / "b"), windows, **SMALL)  # another place, another attempt id in every name
    assert first.identity == again.identity
    assert first.manifest.shards[0].entry.name != again.manifest.shards[0].entry.name
    changed = np.array(windows)
    changed[100, 3] += 1
    assert pack_records(str(tmp_path / "c"), changed, **SMALL).identity != first.identity
    other_parts = pack_records(str(tmp_path / "d"), windows, shard_bytes=16 * 1024, part_bytes=8192)
    assert other_parts.identity != first.identity  # other part digests: other bytes vouched for
    held_out = ShardedDataset(str(tmp_path / "a")).take(600, 624)
    assert len(held_out) == 24 and (held_out[0] == windows[600]).all()
    assert held_out.data_identity != first.identity


def test_packing_refuses_what_cannot_be_a_dataset(tmp_path, cache):
    pack_records(str(tmp_path / "a"), token_windows(tokens(), 32), **SMALL)
    with pytest.raises(ConfigError, match="already holds a dataset"):
        pack_records(str(tmp_path / "a"), token_windows(tokens(), 32), **SMALL)
    with pytest.raises(ConfigError, match="shape \\(N, ...\\)"):
        pack_records(str(tmp_path / "b"), np.zeros(5), **SMALL)
    with pytest.raises(ConfigError, match="cannot be packed"):
        pack_records(str(tmp_path / "c"), np.zeros((4, 2), dtype=np.complex64), **SMALL)
    with pytest.raises(ConfigError, match="smaller than the part size"):
        pack_records(str(tmp_path / "d"), np.zeros((4, 2)), shard_bytes=1024, part_bytes=4096)
    with pytest.raises(ConfigError, match="fewer than context"):
        token_windows(np.arange(10), 32)


# -- a bucket that is not what its manifest says ------------------------------------------------------------------
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_naming_the_shard_and_the_part(tmp_path, cache):
    windows = token_windows(tokens(), 32)
    packed = pack_records(str(tmp_path / "d"), windows, **SMALL)
    _flip(shard_path(tmp_path / "d", packed, 1), 5000)  # part 2 of shard 1 (bytes 4096..8192)
    data = ShardedDataset(str(tmp_path / "d"))  # same size: the listing check cannot see it
    assert (data[248] == windows[248]).all()  # shard 1, part 1: intact, used
    name = packed.manifest.shards[1].entry.name
    with pytest.raises(DataError, match=f"shard {name} part 2/4 \\(bytes 4096..8192\\) does not match its sha256"):
        data[248 + 5000 // 66]
    with pytest.raises(DataError, match=name):
        data.verify()


def test_a_missing_or_resized_shard_is_named_when_the_dataset_is_opened(tmp_path, cache):
    packed = pack_records(str(tmp_path / "d"), token_windows(tokens(), 32), **SMALL)
    victim = shard_path(tmp_path / "d", packed, 2)
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(DataError, match=f"shard {victim.name} is {victim.stat().st_size} bytes, dataset.json says"):
        ShardedDataset(str(tmp_path / "d"))
    victim.unlink()
    with pytest.raises(DataError) as caught:
        ShardedDataset(str(tmp_path / "d"))
    assert str(caught.value) == (f"dataset {tmp_path / 'd'}: shard {victim.name} is missing (dataset.json lists it): "
                                 "restore it or pack the dataset again")
    with pytest.raises(ConfigError, match="no dataset.json, nothing is there: check the task's dataset URL"):
        ShardedDataset(str(tmp_path / "nothing-here"))  # the operator's setting (exit 2)
    (tmp_path / "d" / DATASET_FILE).unlink()
    with pytest.raises(DataError, match="no dataset.json .*: restore it or pack the dataset again"):
        ShardedDataset(str(tmp_path / "d"))  # shards without their manifest: stored content (exit 1)


def _manifest(tmp_path: Path) -> dict:
    pack_records(str(tmp_path / "m"), token_windows(tokens(3000), 32), **SMALL)
    return json.loads((tmp_path / "m" / DATASET_FILE).read_text())


def _tamper(doc: dict, how: str) -> dict:
    shard = doc["shards"][0]
    changes = {
        "schema": lambda: doc.update(schema="trainproof.dataset/9"),
        "kind": lambda: doc.update(kind="pickle"),
        "dtype": lambda: doc.update(dtype="O"),
        "shape": lambda: doc.update(shape=[0]),
        "huge record": lambda: doc.update(shape=[2**30, 2**30]),
        "samples": lambda: doc.update(samples=doc["samples"] + 1),
        "name": lambda: shard.update(name="../../etc/passwd"),
        "duplicate": lambda: doc["shards"].append(dict(shard)),
        "size": lambda: shard.update(bytes=shard["bytes"] - 66),
        "part digest": lambda: shard["parts"].__setitem__(0, "0" * 64),
        "part count": lambda: shard.update(parts=shard["parts"][:-1]),
        "part size": lambda: shard.update(part_bytes=1),
        "huge part": lambda: (shard.update(part_bytes=32 * 2**20), shard.pop("parts")),
        "index": lambda: shard.update(index_offset=0),
        "identity": lambda: doc.update(identity="f" * 64),
        "no shards": lambda: doc.update(shards=[]),
    }
    changes[how]()
    return doc


@pytest.mark.parametrize(("how", "message"), [
    ("schema", "not a trainproof.dataset/1"), ("kind", "kind 'pickle'"), ("dtype", "dtype 'O'"),
    ("shape", "shape is not"), ("huge record", "larger than"), ("samples", "do not add up"),
    ("name", "invalid name"), ("duplicate", "do not add up|twice"), ("size", r"is \d+ bytes, not \d+ records"),
    ("part digest", "do not hash to its sha256"), ("part count", r"need \d+ part digest"), ("part size", "part_bytes"),
    ("huge part", "more than 16777216"),
    ("index", "records dataset has an index"), ("identity", "recorded identity"), ("no shards", "1..1000000"),
])
def test_a_hostile_manifest_is_refused_naming_what_is_wrong(tmp_path, how, message):
    raw = json.dumps(_tamper(_manifest(tmp_path), how)).encode()
    with pytest.raises(ValueError, match=message):
        dm.parse(raw)


@pytest.mark.parametrize("raw", [b"[" * 100 + b"]" * 100, b'{"schema": NaN}', b"\xff\xfe", b"{}" + b" " * (65 << 20)])
def test_a_manifest_that_is_not_json_or_too_big_is_refused(raw):
    with pytest.raises(ValueError):
        dm.parse(raw)


# -- the command line -----------------------------------------------------------------------------------------------
def test_data_pack_and_verify_from_the_command_line(cli, tmp_path, cache):  # noqa: F811
    np.save(tmp_path / "tokens.npy", tokens())
    out = str(tmp_path / "ds")
    result = cli("data", "pack", out, "--tokens", str(tmp_path / "tokens.npy"), "--context", "32", "--shard-mib",
                 "0.015625", "--part-kib", "4")
    assert result.exit_code == 0, result.output
    packed = json.loads(result.stdout)
    assert (packed["samples"], packed["shards"], packed["shape"]) == (624, 3, [33])
    result = cli("data", "verify", out)
    assert result.exit_code == 0 and json.loads(result.stdout)["identity"] == packed["identity"]
    assert json.loads(result.stdout)["bytes_read"] == packed["bytes"]

    manifest = dm.parse((tmp_path / "ds" / DATASET_FILE).read_bytes())
    _flip(tmp_path / "ds" / manifest.shards[0].entry.name, 10)
    result = cli("data", "verify", out)
    assert result.exit_code == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert f"shard {manifest.shards[0].entry.name} part 1/4" in lines[-1] and lines[-1].startswith("trainproof: error")
    (tmp_path / "ds" / manifest.shards[2].entry.name).unlink()
    result = cli("data", "verify", out)
    assert result.exit_code == 1 and f"shard {manifest.shards[2].entry.name} is missing" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    again = cli("data", "pack", out, "--tokens", str(tmp_path / "tokens.npy"), "--context", "32")
    assert again.exit_code == 2 and "already holds a dataset" in again.stderr
    both = cli("data", "pack", str(tmp_path / "x"), "--tokens", str(tmp_path / "tokens.npy"), "--records", "y.npy")
    assert both.exit_code == 2 and "exactly one of" in both.stderr
    np.save(tmp_path / "rows.npy", np.arange(60, dtype=np.float32).reshape(10, 2, 3))
    result = cli("data", "pack", str(tmp_path / "rows"), "--records", str(tmp_path / "rows.npy"))
    assert result.exit_code == 0 and json.loads(result.stdout)["shape"] == [2, 3], result.output
    assert (ShardedDataset(str(tmp_path / "rows"))[9] == np.arange(54, 60).reshape(2, 3)).all()
    files = [tmp_path / f"f{i}.bin" for i in range(5)]
    for i, f in enumerate(files):
        f.write_bytes(bytes(range(i * 10)))
    result = cli("data", "pack", str(tmp_path / "files"), "--files", str(tmp_path / "f*.bin"))
    assert result.exit_code == 0, result.output
    assert bytes(ShardedDataset(str(tmp_path / "files"))[3]) == bytes(range(30))


# -- the part cache -------------------------------------------------------------------------------------------------
def test_the_part_cache_keeps_to_its_bound_and_serves_a_second_reader(tmp_path):
    windows = token_windows(tokens(200_000), 64)  # about 400 KiB: 100 parts of 4 KiB
    url = str(tmp_path / "d")
    pack_records(url, windows, **SMALL)
    bounded = ShardedDataset(url, cache_dir=str(tmp_path / "small-cache"), cache_mib=1)
    ordered = list(range(len(bounded)))
    for start in range(0, len(ordered), 64):
        bounded.__getitems__(ordered[start:start + 64])
    held = sum(f.stat().st_size for f in (tmp_path / "small-cache").rglob("*") if f.is_file())
    assert 0 < held <= 2**20
    whole = ShardedDataset(url, cache_dir=str(tmp_path / "cache"), cache_mib=64)
    whole.verify()
    reader = ShardedDataset(url, cache_dir=str(tmp_path / "cache"), cache_mib=64)
    assert (reader[len(reader) - 1] == windows[-1]).all()
    assert reader._reader.fetched_bytes == 0  # every part came from the shared cache


def test_a_cached_part_of_the_wrong_size_is_fetched_again(tmp_path):
    url = str(tmp_path / "d")
    packed = pack_records(url, token_windows(tokens(), 32), **SMALL)
    data = ShardedDataset(url, cache_dir=str(tmp_path / "cache"))
    data[0]
    part = PartCache(str(tmp_path / "cache"), 2**20).path(packed.manifest.shards[0].entry.parts[0])
    Path(part).write_bytes(b"short")
    again = ShardedDataset(url, cache_dir=str(tmp_path / "cache"))
    assert (again[0] == token_windows(tokens(), 32)[0]).all() and again._reader.fetched_bytes == 4096


def test_a_cached_part_changed_on_disk_is_fetched_again_never_used(tmp_path, caplog):
    url = str(tmp_path / "d")
    packed = pack_records(url, token_windows(tokens(), 32), **SMALL)
    data = ShardedDataset(url, cache_dir=str(tmp_path / "cache"))
    data[0]
    part = Path(PartCache(str(tmp_path / "cache"), 2**20).path(packed.manifest.shards[0].entry.parts[0]))
    changed = bytearray(part.read_bytes())
    changed[5] ^= 0x01  # the same size: only its digest can tell
    part.write_bytes(bytes(changed))
    again = ShardedDataset(url, cache_dir=str(tmp_path / "cache"))
    assert (again[0] == token_windows(tokens(), 32)[0]).all() and again._reader.fetched_bytes == 4096
    assert "does not match its sha256: fetching it again" in caplog.text
    assert again[1].tobytes() == token_windows(tokens(), 32)[1].tobytes() and again._reader.fetched_bytes == 4096


def test_eviction_only_touches_the_caches_own_files(tmp_path):
    mine = [tmp_path / "cache" / "notes" / "keep.txt", tmp_path / "cache" / "ab" / "keep.txt"]
    for path in mine:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 2**20)
    PartCache(str(tmp_path / "cache"), 2**19)
    assert all(path.exists() for path in mine)


def test_a_default_cache_folder_not_this_users_own_is_passed_over_for_a_private_one(tmp_path, monkeypatch, caplog):
    from trainproof.data import reader

    monkeypatch.setenv("TRAINPROOF_SPOOL_DIR", str(tmp_path))
    monkeypatch.delenv("TRAINPROOF_DATA_CACHE", raising=False)
    default = tmp_path / f"trainproof-data-cache-{os.getuid()}"
    assert cache_settings()[0] == str(default) and (default.stat().st_mode & 0o777) == 0o700
    elsewhere = tmp_path / "planted"
    elsewhere.mkdir()

    def occupied(why: str) -> None:
        monkeypatch.setattr(reader, "_PRIVATE", {})
        caplog.clear()
        folder = Path(cache_settings()[0])
        assert folder != default and folder.parent == tmp_path and folder.is_dir() and not folder.is_symlink()
        assert (folder.stat().st_mode & 0o777) == 0o700 and folder.stat().st_uid == tmp_path.stat().st_uid
        assert f"the data cache folder {tmp_path / default.name} {why}: caching in a private folder" in caplog.text
        assert cache_settings()[0] == str(folder)  # once per process: the same private folder, one warning
        assert caplog.text.count("caching in a private folder") == 1

    default.chmod(0o777)
    occupied("can be written by others (mode 777)")
    default.rmdir()
    default.symlink_to(elsewhere)
    occupied("is a symbolic link")
    assert list(elsewhere.iterdir()) == []
    default.unlink()
    real = os.getuid()
    default = tmp_path / f"trainproof-data-cache-{real + 1}"
    default.mkdir(mode=0o700)  # made first by "another user": this process now runs as uid real + 1
    monkeypatch.setattr(os, "getuid", lambda: real + 1)
    occupied(f"belongs to another user (uid {real})")


def test_a_given_cache_folder_others_can_write_is_refused_in_one_line(cli, tmp_path, monkeypatch):  # noqa: F811
    url = str(tmp_path / "d")
    pack_records(url, token_windows(tokens(), 32), **SMALL)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=f"data cache folder {shared} can be written by others"):
        ShardedDataset(url, cache_dir=str(shared))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "d")
    with pytest.raises(ConfigError, match=f"data cache folder {link} is a symbolic link"):
        ShardedDataset(url, cache_dir=str(link))
    monkeypatch.setenv("TRAINPROOF_DATA_CACHE", str(shared))
    result = cli("data", "verify", url)
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        f"trainproof: error: data cache folder {shared} can be written by others (mode 777), so parts cached there "
        "could be changed behind this run's back: set TRAINPROOF_DATA_CACHE to a folder of your own that only you can "
        "write (chmod 700), not a symbolic link"]


def test_an_object_entry_is_checked_before_use_and_a_part_is_read_once_more_on_a_mismatch(tmp_path):
    store = open_store(str(tmp_path / "objects"))
    store.write_file("blob", os.urandom(10_000))
    from trainproof.storage.digest import digest_bytes

    digest = digest_bytes(store.read_file("blob"), part_bytes=4096)
    entry = parse_entry({"name": "blob", "bytes": 10_000, "sha256": str(digest), "part_bytes": 4096,
                         "parts": list(digest.parts)}, max_bytes=2**20)
    reader = ObjectReader(store, PartCache(str(tmp_path / "cache"), 2**20))
    assert reader.read([(entry, 4000, 4200)])[0] == store.read_file("blob")[4000:4200]
    with pytest.raises(ValueError, match="do not hash"):
        parse_entry({**entry.meta(), "parts": list(reversed(digest.parts))}, max_bytes=2**20)
    flaky, calls = store.read_range, []

    def once_wrong(name, start, end):
        calls.append(start)
        data = flaky(name, start, end)
        return b"x" + data[1:] if len(calls) == 1 else data

    store.read_range = once_wrong
    fresh = ObjectReader(store, PartCache(str(tmp_path / "cache2"), 2**20))
    assert fresh.read([(entry, 9000, 10_000)])[0] == store.read_file("blob")[9000:]
    assert calls == [8192, 8192]
    store.read_range = lambda name, start, end: b"y" * (end - start)
    with pytest.raises(CorruptObjectError, match="part 1/3"):
        ObjectReader(store, PartCache(str(tmp_path / "cache3"), 2**20)).read([(entry, 0, 10)])


def _read_in_child(data, queue):
    queue.put([bytes(s) for s in data.__getitems__([0, 300])] + [data._pid == os.getpid()])


def test_a_forked_process_reads_through_its_own_client(tmp_path, cache):
    url = str(tmp_path / "d")
    windows = token_windows(tokens(), 32)
    pack_records(url, windows, **SMALL)
    data = ShardedDataset(url)
    data[1]  # the parent has a client, a pool, cached parts
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(data, queue))
    child.start()
    first, second, own = queue.get(timeout=budget(60))
    child.join(30)
    assert child.exitcode == 0 and own
    assert first == windows[0].tobytes() and second == windows[300].tobytes()
