"""Each storage safety check must have a test that fails without it: remove one check at a time (a textual
mutation of storage/), run the tests meant to catch it, restore the file, and report caught / MISSED.

    .venv/bin/python bench/storage_mutations.py [NAME-SUBSTRING ...]

Leaves the tree as it found it (each file is restored in a finally); run it on a clean checkout.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = [
 ("verify sha compare", "trainproof/storage/commit.py", "if got != (size, sha):", "if False:", "tests/test_storage_safety.py -k 'read_back'"),
 ("412 attempt compare (always conflict)", "trainproof/storage/commit.py", 'if theirs.get("attempt") != manifest["attempt"]:', "if True:", "tests/test_storage_safety.py -k 'own_marker'"),
 ("412 attempt compare (never conflict)", "trainproof/storage/commit.py", 'if theirs.get("attempt") != manifest["attempt"]:', "if False:", "tests/test_storage_safety.py -k 'another_writers or unreadable_marker'"),
 ("plain name rule", "trainproof/storage/manifest.py", "    problem = plain_name_problem(name)\n", "    problem = None\n", "tests/test_storage_hostile.py -k 'plain or control or dotdot or absolute or empty'"),
 ("commit name rule", "trainproof/storage/commit.py", "bad = {n: mf.name_problem(n) for n in files if mf.name_problem(n)}", "bad = {}", "tests/test_storage_hostile.py -k 'commit_refuses'"),
 ("manifest size by listing", "trainproof/storage/generations.py", "if entries[mf.MARKER].size > ctx.limits.manifest_bytes:", "if False:", "tests/test_storage_hostile.py -k oversized_manifest"),
 ("json size cap", "trainproof/storage/limits.py", "    if len(raw) > max_bytes:\n", "    if False:\n", "tests/test_storage_hostile.py -k 'untrusted or read_json'"),
 ("file_bytes cap", "trainproof/storage/manifest.py", 'if not 0 <= meta["bytes"] <= limits.file_bytes:', 'if not 0 <= meta["bytes"]:', "tests/test_storage_hostile.py -k 'above_the_cap or bytes_negative'"),
 ("bounded load read", "trainproof/storage/generations.py", "lambda: read_hashed(ctx.backend, path, size))", "lambda: (lambda d: (d, __import__(\"hashlib\").sha256(d).hexdigest()))(ctx.backend.read(path)))", "tests/test_storage_hostile.py -k swapped"),
 ("int digits", "trainproof/storage/limits.py", "    if len(text.lstrip(\"-\")) > MAX_INT_DIGITS:\n", "    if False:\n", "tests/test_storage_hostile.py -k 'untrusted'"),
 ("recursion catch", "trainproof/storage/limits.py", "    except RecursionError:\n", "    except ZeroDivisionError:\n", "tests/test_storage_hostile.py -k 'deeply or untrusted or reason'"),
 ("depth cap", "trainproof/storage/limits.py", "    if _depth(value) > MAX_JSON_DEPTH:\n", "    if False:\n", "tests/test_storage_hostile.py -k 'depth_cap or untrusted'"),
 ("non-finite", "trainproof/storage/limits.py", "    if not math.isfinite(value):\n", "    if False:\n", "tests/test_storage_hostile.py -k 'infinity or untrusted'"),
 ("NaN constant", "trainproof/storage/limits.py", "parse_constant=_no_constant,", "", "tests/test_storage_hostile.py -k 'nan or untrusted or read_json'"),
 ("duplicate keys", "trainproof/storage/limits.py", "    if len(out) != len(pairs):\n", "    if False:\n", "tests/test_storage_hostile.py -k 'duplicate or untrusted'"),
 ("manifest types (bool world)", "trainproof/storage/manifest.py", "if not isinstance(value, kind) or isinstance(value, bool):", "if not isinstance(value, kind):", "tests/test_storage_hostile.py -k 'world-is-bool'"),
 ("scan cap", "trainproof/storage/generations.py", "    truncated = len(listing) > cap\n", "    truncated, listing, cap = False, listing, 10**9\n", "tests/test_storage_hostile.py -k scans_stop"),
 ("objects per generation cap", "trainproof/storage/generations.py", "    if len(listing) > cap:\n        return GenerationInfo(status=CORRUPT", "    if False:\n        return GenerationInfo(status=CORRUPT", "tests/test_storage_hostile.py -k too_many"),
 ("truncated scan stops retention", "trainproof/storage/retention.py", "    if found.truncated:", "    if False:", "tests/test_storage_hostile.py -k scans_stop"),
 ("latest hint validation", "trainproof/storage/store.py", "if mf.parse_step_dir(text) is None:", "if not text:", "tests/test_storage_hostile.py -k latest_hint"),
 ("reason defensive parse", "trainproof/storage/quarantine.py", "reason = loads_untrusted(raw, what=\"REASON\", max_bytes=cap)", "reason = json.loads(raw)", "tests/test_storage_hostile.py -k reason"),
 ("retention contract filter", "trainproof/storage/retention.py", "    return (contract is None or manifest[\"contract\"] == contract) and", "    return True or", "tests/test_storage_retention.py -k 'another_contract or world_filter or plan_retention_counts'"),
 ("mixed contracts guard", "trainproof/storage/retention.py", "    if len(contracts) > 1:", "    if False:", "tests/test_storage_retention.py -k mixed"),
 ("commit keep passes contract", "trainproof/storage/store.py", 'else replace(retention, contract=manifest["contract"])', "else retention", "tests/test_storage_retention.py -k commit_with_keep"),
 ("re-verify newest", "trainproof/storage/retention.py", "    if doomed and not _newest_verifies(", "    if False and not _newest_verifies(", "tests/test_storage_retention.py -k 'fails_verification or no_generation_verifies'"),
 ("grace floor", "trainproof/storage/retention.py", "    if grace_seconds < MIN_GRACE_SECONDS and not i_know_no_writer_is_active:", "    if False:", "tests/test_storage_retention.py -k grace"),
 ("lstat in listdir", "trainproof/storage/backend.py", "st = e.stat(follow_symlinks=False)", "st = e.stat()", "tests/test_storage_retention.py -k symlink"),
 ("O_NOFOLLOW delete_folder", "trainproof/storage/backend.py", "fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)", "fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)", "tests/test_storage_retention.py -k local_folder_deletes"),
 ("commit refuses symlinked folder", "trainproof/storage/commit.py", "    if here and (here[0].is_special or not here[0].is_dir):", "    if False:", "tests/test_storage_retention.py -k write_through"),
 ("redact_url", "trainproof/storage/limits.py", "    text = str(url)\n", "    return str(url)\n", "tests/test_storage_safety.py -k 'redact or never_carry'"),
 ("refuse creds in s3 url", "trainproof/storage/store.py", '    if "@" in bucket or ":" in bucket:', "    if False:", "tests/test_storage_safety.py -k refused_without"),
 ("O_NOFOLLOW read", "trainproof/storage/backend.py", 'flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) |', 'flags = os.O_RDONLY |', "tests/test_storage_hostile.py -k 'symlink_is_never_read'"),
 ("O_NONBLOCK read", "trainproof/storage/backend.py", '| getattr(os, "O_NONBLOCK", 0) |', '|', "tests/test_storage_hostile.py -k fifo"),
 ("S_ISREG read", "trainproof/storage/backend.py", "        if not stat.S_ISREG(os.fstat(fd).st_mode):\n", "        if False:\n", "tests/test_storage_hostile.py -k fifo"),
 ("verify listing size first", "trainproof/storage/commit.py", "        if obj in sizes and sizes[obj] != size:", "        if False:", "tests/test_storage_safety.py -k wrong_sized"),
 ("inspect claimed size vs listing", "trainproof/storage/generations.py", '        if entries[obj].size != meta["bytes"]:', "        if False:", "tests/test_storage_hostile.py -k 'what_the_object_holds'"),
]
only = sys.argv[1:]
missed = 0
for name, f, old, new, tests in M:
    if only and not any(o in name for o in only):
        continue
    path = f"{ROOT}/{f}"
    src = open(path).read()
    if src.count(old) != 1:
        print(f"BAD PATTERN ({src.count(old)}): {name}"); continue
    open(path, "w").write(src.replace(old, new))
    try:
        r = subprocess.run(f".venv/bin/python -m pytest -q -x -p no:cacheprovider {tests}", shell=True, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    finally:
        open(path, "w").write(src)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
    missed += r.returncode != 1
    print(f"{'caught' if r.returncode == 1 else 'MISSED' if r.returncode == 0 else 'rc=%d' % r.returncode}: {name}: {last}", flush=True)
sys.exit(1 if missed else 0)
