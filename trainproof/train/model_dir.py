"""A Hugging Face model directory as pretrained weights: its listing, its digest, and reading it verified.

A published model is a folder: ``config.json``, ``model.safetensors`` or its shards ``model-0000k-of-0000n.safetensors``
with ``model.safetensors.index.json``, the tokenizer's files. ``trainproof digest URL`` (:func:`seal`) reads every file
of the folder through the store, hashing it, and writes ``trainproof-listing.json`` into it: every other file's name,
size and sha256, sorted by name, as canonical JSON. The directory's **digest** is the sha256 of that file's bytes (what
``sha256sum trainproof-listing.json`` prints): one value covering every byte of every file, which a task declares
(``Pretrained(url=..., digest=...)``) and the run contract records (``init_sha256``).

Which files count: every entry of the folder. A subfolder, a symbolic link or any other special file is refused by
name, never skipped (copy the directory without it, or with its links resolved: ``cp -rL``).

On a fresh start :func:`fetch` reads the listing (capped) and requires it to hash to the declared digest before it is
parsed; the folder must then hold exactly the listed files with their listed sizes (an extra, a missing or a resized
file is named); every file is downloaded, at most its listed size, into a local spool file while it is hashed, and
refused by name unless it has the listed sha256. Stored content that is not what was declared is a DataError (exit 1:
put the directory back and the Job's retry goes on); a declared directory that cannot be loaded (no weights, an index
naming a shard the directory never had, a shard not holding what the index maps to it) is a ConfigError (exit 2).

The bucket may be shared and hostile: nothing read is executed. JSON (the listing, the index, ``config.json``) is parsed
by trainproof.storage.limits' defensive parser, capped and type-checked; weights are parsed by the safetensors library
one tensor at a time (trainproof.train.pretrained), only after their bytes matched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from trainproof.errors import ConfigError, DataError
from trainproof.storage import StoreOptions, open_store, redact_url
from trainproof.storage.errors import StoreConfigError
from trainproof.storage.limits import loads_untrusted, plain_name_problem
from trainproof.storage.spool import Spool, spool_dir

LISTING = "trainproof-listing.json"
SCHEMA = "trainproof.model-directory/1"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
MAX_FILES = 10_000
"""Files a directory may hold (a 400 B-parameter model ships a few hundred)."""
MAX_LISTING_BYTES = 4 * 2**20
MAX_INDEX_BYTES = 64 * 2**20
"""``model.safetensors.index.json``: about 100 bytes a tensor, so room for half a million tensors."""
MAX_CONFIG_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Listed:
    """One file of a directory as its listing names it."""

    name: str
    size: int
    sha256: str


@dataclass
class Weights:
    """A verified safetensors file to load: its label for messages, its spool, and the tensors the index maps to it
    (None: every tensor it holds, a single ``model.safetensors`` or a plain file)."""

    label: str
    spool: Spool
    tensors: list[str] | None = None


@dataclass
class Fetched:
    """A directory read and verified: its weights files (spools the caller unlinks) and what to report."""

    weights: list[Weights]
    record: dict[str, Any]
    bytes: int = 0
    others: list[str] = field(default_factory=list)


def listing_bytes(files: list[Listed]) -> bytes:
    """The listing file's bytes: canonical JSON (sorted keys, no whitespace) and a newline; its sha256 is the
    directory's digest."""
    doc = {"schema": SCHEMA, "files": [{"name": f.name, "size": f.size, "sha256": f.sha256}
                                       for f in sorted(files, key=lambda f: f.name)]}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"


def parse_listing(raw: bytes, where: str) -> list[Listed]:
    """The files ``raw`` (a listing's bytes) names; ConfigError naming what is malformed."""
    try:
        doc = loads_untrusted(raw, what=LISTING, max_bytes=MAX_LISTING_BYTES)
    except ValueError as exc:
        raise ConfigError(f"pretrained weights {where}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("files"), list):
        raise ConfigError(f"pretrained weights {where}: {LISTING} is not a {SCHEMA} listing")
    files = [_listed(entry, where) for entry in doc["files"]]
    names = [f.name for f in files]
    if not files or len(files) > MAX_FILES or names != sorted(set(names)):
        raise ConfigError(f"pretrained weights {where}: {LISTING} must list 1 to {MAX_FILES} files, each once, "
                          "sorted by name")
    return files


def _listed(entry: Any, where: str) -> Listed:
    fields = entry if isinstance(entry, dict) and set(entry) == {"name", "size", "sha256"} else {}
    name, size, sha = fields.get("name"), fields.get("size"), fields.get("sha256")
    if not (isinstance(name, str) and plain_name_problem(name) is None and name != LISTING
            and isinstance(size, int) and not isinstance(size, bool) and size >= 0
            and isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise ConfigError(f"pretrained weights {where}: {LISTING} has a malformed entry {str(entry)[:80]!r}")
    return Listed(name, size, sha)


# -- which files are the weights --------------------------------------------------------------------------
def weights_layout(names: set[str], index: bytes | None, where: str) -> dict[str, list[str] | None]:
    """The weights files of a directory holding ``names``: ``{shard: [tensor, ...]}`` from the index (``index``: its
    bytes, when the directory has one), or ``{"model.safetensors": None}``. ConfigError naming what is wrong."""
    if INDEX in names and SINGLE in names:
        raise ConfigError(f"pretrained weights {where} hold both {SINGLE} and {INDEX}: keep one of them (which weights "
                          "would be meant is not for trainproof to guess)")
    if SINGLE in names:
        return {SINGLE: None}
    if index is None:
        raise ConfigError(f"pretrained weights {where} hold neither {SINGLE} nor {INDEX}: not a Hugging Face model "
                          "directory in safetensors format")
    return dict(shard_map(index, names, where))


def shard_map(raw: bytes, names: set[str], where: str) -> dict[str, list[str]]:
    """``{shard: [tensor, ...]}`` from an index's ``weight_map`` (tensor -> shard), every shard one of ``names``."""
    try:
        doc = loads_untrusted(raw, what=INDEX, max_bytes=MAX_INDEX_BYTES)
    except ValueError as exc:
        raise ConfigError(f"pretrained weights {where}: {exc}") from None
    mapping = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError(f"pretrained weights {where}: {INDEX} has no weight_map (tensor name -> shard file)")
    shards: dict[str, list[str]] = {}
    for tensor, shard in mapping.items():
        if not isinstance(shard, str) or plain_name_problem(shard) or not shard.endswith(".safetensors"):
            raise ConfigError(f"pretrained weights {where}: {INDEX} maps tensor {tensor[:120]!r} to "
                              f"{str(shard)[:120]!r}, which is not a .safetensors file's name")
        if shard not in names:
            raise ConfigError(f"pretrained weights {where}: shard {shard}, which {INDEX} names for tensor "
                              f"{tensor[:120]!r}, is not in the directory")
        shards.setdefault(shard, []).append(tensor)
    return shards


def config_summary(raw: bytes, where: str) -> dict[str, Any]:
    """What ``config.json`` says of the model, for the report (read, never obeyed): ``architectures`` and
    ``model_type`` when they are what they should be. ConfigError when it is not a JSON object."""
    try:
        doc = loads_untrusted(raw, what=CONFIG, max_bytes=MAX_CONFIG_BYTES)
    except ValueError as exc:
        raise ConfigError(f"pretrained weights {where}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"pretrained weights {where}: {CONFIG} is not a JSON object")
    out: dict[str, Any] = {}
    arch = doc.get("architectures")
    if isinstance(arch, list) and all(isinstance(a, str) for a in arch):
        out["architectures"] = [a[:120] for a in arch[:8]]
    if isinstance(doc.get("model_type"), str):
        out["model_type"] = doc["model_type"][:120]
    return out


# -- trainproof digest ------------------------------------------------------------------------------------
def seal(url: str, options: StoreOptions | None = None) -> dict[str, Any]:
    """Hash every file of the directory at ``url`` and write its listing there (create-only), or check the listing
    already there. Returns the digest and what was counted. ConfigError (exit 2) for a folder that cannot be a model
    directory (a subfolder or a link in it, no weights, an index naming a file it does not hold); DataError (exit 1)
    when a listing is there that does not list the files (naming the first difference)."""
    where = redact_url(url)
    store = open_directory(url, options)
    names = _plain_files(store, where)
    files, index, config = [], None, None
    for name in names:
        spool = _download(store, where, name, None)
        try:
            files.append(Listed(name, spool.size, spool.sha256))
            if name in (INDEX, CONFIG):
                index, config = (_small(spool), config) if name == INDEX else (index, _small(spool))
        finally:
            spool.unlink()
    layout = weights_layout(set(names), index, where)
    described = config_summary(config, where) if config is not None else {}
    data = listing_bytes(files)
    written = _write_listing(store, where, data)
    return {"directory": where, "digest": hashlib.sha256(data).hexdigest(), "files": len(files),
            "bytes": sum(f.size for f in files), "weights": sorted(layout), "listing": written, **described}


def _plain_files(store: Any, where: str) -> list[str]:
    entries = store.list_dir(limit=MAX_FILES)
    if len(entries) > MAX_FILES:
        raise ConfigError(f"{where} holds more than {MAX_FILES} entries: not a model directory")
    odd = sorted(e.name for e in entries if e.is_dir or e.is_special)
    if odd:
        raise ConfigError(f"{where} holds {odd[0]!r}, which is a folder or a link, not a file: a model directory "
                          "holds files only (copy it without the folder, or with links resolved: cp -rL)")
    names = sorted(e.name for e in entries if e.name != LISTING)
    if not names:
        raise ConfigError(f"{where} does not exist or holds no files")
    return names


def _small(spool: Spool) -> bytes:
    cap = max(MAX_INDEX_BYTES, MAX_CONFIG_BYTES)
    if spool.size > cap:
        raise ConfigError(f"a model directory's {INDEX} or {CONFIG} is {spool.size} bytes, more than {cap}")
    with open(spool.path, "rb") as fh:
        return fh.read(cap + 1)


def _write_listing(store: Any, where: str, data: bytes) -> str:
    """Write the listing create-only; 'written', or 'unchanged' when the same bytes are there already."""
    try:
        store.write_file(LISTING, data, create_only=True)
        return "written"
    except FileExistsError:
        pass
    old = store.read_file(LISTING, max_bytes=MAX_LISTING_BYTES)
    if old == data:
        return "unchanged"
    try:
        diffs = differences(parse_listing(old, where), parse_listing(data, where))
    except ConfigError:
        diffs = [f"{LISTING} there is not a listing"]
    raise DataError(f"{where} holds a {LISTING} that does not list its files: {diffs[0]}"
                    + (f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else "")
                    + f". Put back the listed files, or delete {LISTING} to list the files as they are now (another "
                      "digest: another experiment)")


def differences(old: list[Listed], new: list[Listed]) -> list[str]:
    """What changed between two listings, one phrase per file, by name."""
    before, after = {f.name: f for f in old}, {f.name: f for f in new}
    out = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if b is None:
            out.append(f"{name} is listed but not in the directory")
        elif a is None:
            out.append(f"{name} is in the directory but not listed")
        elif a != b:
            out.append(f"{name} has sha256 {b.sha256} ({b.size} bytes), not the listed {a.sha256} ({a.size} bytes)")
    return out


# -- a fresh start ----------------------------------------------------------------------------------------
def fetch(url: str, digest: str, options: StoreOptions | None = None) -> Fetched:
    """The directory at ``url`` verified against ``digest``: its weights files in local spools (the caller unlinks
    them), every other file read and hashed. DataError (exit 1) naming the file for stored content that is not the
    declared directory's; ConfigError (exit 2) for no directory, no listing, or a declared one that cannot load."""
    where = redact_url(url)
    store = open_directory(url, options)
    listing = _verified_listing(store, where, digest)
    _check_present(store, where, listing)
    by_name = {f.name: f for f in listing}
    small = {n: _read_verified(store, where, by_name[n]) for n in (INDEX, CONFIG) if n in by_name}
    layout = weights_layout(set(by_name), small.get(INDEX), where)
    record: dict[str, Any] = {"url": where, "digest": digest, "files": len(listing), "weights": sorted(layout),
                              **(config_summary(small[CONFIG], where) if CONFIG in small else {})}
    weights: list[Weights] = []
    try:
        for name in sorted(layout):
            weights.append(Weights(f"{where}/{name}", _verified(store, where, by_name[name]), layout[name]))
        others = [f.name for f in listing if f.name not in layout and f.name not in small]
        for name in others:
            _verified(store, where, by_name[name]).unlink()
    except BaseException:
        for w in weights:
            w.spool.unlink()
        raise
    return Fetched(weights, record, sum(f.size for f in listing), others)


def open_directory(url: str, options: StoreOptions | None = None) -> Any:
    """The store rooted at the directory: a local path, ``file://`` or ``s3://`` URL (the run's S3 settings)."""
    scheme = urlparse(url).scheme.lower()
    if scheme not in ("", "file", "s3", "s3a"):
        raise ConfigError(f"pretrained weights {redact_url(url)}: unsupported scheme {scheme!r}; use a local path, "
                          "file:///abs/path or s3://bucket/prefix")
    try:
        return open_store(url, options or StoreOptions.from_env())
    except (StoreConfigError, ValueError) as exc:
        raise ConfigError(f"pretrained weights {redact_url(url)}: {exc}") from None


def _verified_listing(store: Any, where: str, digest: str) -> list[Listed]:
    try:
        raw = store.read_file(LISTING, max_bytes=MAX_LISTING_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"pretrained weights {where}: no {LISTING} there (or no directory): a model directory is "
                          f"declared by the digest `trainproof digest {where}` prints, which also writes the "
                          "listing") from None
    got = hashlib.sha256(raw).hexdigest()
    if len(raw) > MAX_LISTING_BYTES or got != digest:
        raise DataError(f"pretrained weights {where}: its {LISTING} hashes to {got}, not the declared digest {digest}: "
                        "the directory was changed or damaged, so the run does not start from it. Put back the "
                        "directory the task declares (the Job's retry then goes on), or declare the new digest "
                        "(another experiment: a new --store)")
    return parse_listing(raw, where)


def _check_present(store: Any, where: str, listing: list[Listed]) -> None:
    """The folder holds exactly the listed files, with their listed sizes (DataError naming the first that is not)."""
    entries = {e.name: e for e in store.list_dir(limit=MAX_FILES + 1) if e.name != LISTING}
    listed = {f.name: f for f in listing}
    extra = sorted(n for n in entries if n not in listed or entries[n].is_dir or entries[n].is_special)
    if len(entries) > MAX_FILES + 1 or extra:
        name = extra[0] if extra else "more entries"
        raise DataError(f"pretrained weights {where}: {name!r} is in the directory but not in its {LISTING}: remove "
                        "it (the declared directory holds only the listed files), and the Job's retry goes on")
    missing = [n for n in listed if n not in entries]
    if missing:
        raise DataError(f"pretrained weights {where}: {missing[0]}, listed in its {LISTING}, is not in the directory"
                        + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
                        + ": put it back, and the Job's retry goes on")
    resized = [n for n, f in listed.items() if entries[n].size != f.size]
    if resized:
        n = resized[0]
        raise DataError(f"pretrained weights {where}: {n} is {entries[n].size} bytes, not the listed {listed[n].size}: "
                        "the file was changed or damaged; put back the listed file, and the Job's retry goes on")


def _read_verified(store: Any, where: str, listed: Listed) -> bytes:
    spool = _verified(store, where, listed)
    try:
        return _small(spool)
    finally:
        spool.unlink()


def _verified(store: Any, where: str, listed: Listed) -> Spool:
    spool = _download(store, where, listed.name, listed.size)
    if spool.size != listed.size or spool.sha256 != listed.sha256:
        spool.unlink()
        raise DataError(f"pretrained weights {where}/{listed.name}: its sha256 is {spool.sha256} ({spool.size} "
                        f"bytes), not the listed {listed.sha256} ({listed.size} bytes): the file was changed or "
                        "damaged, so the run does not start from it. Put back the listed file (the Job's retry then "
                        "goes on), or list the directory again with `trainproof digest` (another digest: another "
                        "experiment)")
    return spool


def _download(store: Any, where: str, name: str, size: int | None) -> Spool:
    try:
        return store.download_file(name, max_bytes=size, directory=spool_dir())
    except FileNotFoundError:
        raise DataError(f"pretrained weights {where}: {name} is not in the directory (it was when listed): put it "
                        "back, and the Job's retry goes on") from None
    except ValueError as exc:  # larger than listed, or changed size while read
        raise DataError(f"pretrained weights {where}: {name}: {exc}") from None
