"""Training state: safe serialisation, the loader's refusals, RNG capture/restore, data position, and
in-process exact resume (including a cut exactly at an epoch boundary)."""

from __future__ import annotations

import io
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from trainproof.train import rng
from trainproof.train.data import EpochSampler, epoch_plan
from trainproof.errors import ConfigError, StateError
from trainproof.format.history import assemble
from trainproof.train.run import build_run, capture_state, restore_state, train_step
from trainproof.format.state import STATE_SCHEMA, Expected, History, check_consistency, decode, encode, runtime_versions
from trainproof.tasks import load_task
from trainproof.tasks.tinylm import TinyLMConfig, TinyLMTask
from trainproof.train.device import configure_determinism
from tests.test_train_helpers import differences

CPU = torch.device("cpu")


def _trained(task_name: str, steps: int, seed: int = 7, config: dict | None = None):
    task = load_task(task_name, config)
    configure_determinism(task, CPU)
    run = build_run(task, CPU, seed)
    for _ in range(steps):
        train_step(run)
    return run


def _meta(contract: str = "c" * 64) -> dict:
    return {"contract": contract, "world": 1, "code_version": "trainproof test", "data_identity": "d" * 64,
            "versions": runtime_versions()}


def _expected(**kw) -> Expected:
    base = dict(contract="c" * 64, world=1, code_version="trainproof test", data_identity="d" * 64, step=5)
    return Expected(**{**base, **kw})


# -- weights-only safety -------------------------------------------------------------------------------

class _Exploit:
    """Unpickling this would create a marker file: proof that a refused load executed nothing."""

    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _raw(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)  # torch.save itself pickles anything: that is what an attacker would do
    return buf.getvalue()


def test_state_round_trips_through_weights_only_bytes():
    state = capture_state(_trained("regression", 3), _meta())
    data = encode(state)
    assert torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["schema"] == STATE_SCHEMA
    assert differences(state, decode(data)) == []


def test_a_pickled_class_instance_is_refused_without_running_it(tmp_path):
    exploit = _Exploit()
    exploit.marker = tmp_path / "executed"
    state = capture_state(_trained("regression", 1), _meta())
    state["meta"]["payload"] = exploit
    with pytest.raises(StateError, match="pickled object"):
        decode(_raw(state))
    assert not exploit.marker.exists()


@pytest.mark.parametrize("payload", [os.system, print, np.zeros(3), np.float64(1.5)],
                         ids=["function", "builtin", "ndarray", "np-scalar"])
def test_callables_and_numpy_objects_are_refused(payload):
    state = capture_state(_trained("regression", 1), _meta())
    state["progress"]["extra"] = payload
    with pytest.raises(StateError, match="pickled object"):
        decode(_raw(state))
    with pytest.raises(StateError, match=r"state\.progress\.extra"):
        encode(state)  # and the trainer could never have written it


def test_subclassed_builtins_are_refused_before_saving():
    state = capture_state(_trained("regression", 1), _meta())
    state["meta"]["torch"] = torch.__version__  # TorchVersion: a str subclass that pickles as its class
    with pytest.raises(StateError, match="TorchVersion"):
        encode(state)


@pytest.mark.parametrize("blob", [b"", b"not a checkpoint", b"PK\x03\x04garbage"], ids=["empty", "text", "zip"])
def test_unreadable_bytes_are_refused(blob):
    with pytest.raises(StateError):
        decode(blob)


def test_a_state_without_schema_or_sections_is_refused():
    with pytest.raises(StateError, match="schema"):
        decode(_raw({"model": {}}))
    with pytest.raises(StateError, match="lacks section"):
        decode(_raw({"schema": STATE_SCHEMA, "model": {}}))


# -- consistency -----------------------------------------------------------------------------------------

@pytest.fixture
def state5():
    return decode(encode(capture_state(_trained("regression", 5), _meta())))


def test_a_consistent_state_passes(state5):
    assert check_consistency(state5, _expected()) == []


@pytest.mark.parametrize(("field", "value", "message"), [
    ("contract", "e" * 64, "contract"), ("code_version", "trainproof 9", "code_version"),
    ("data_identity", "f" * 64, "data_identity"), ("world", 2, "world"), ("step", 6, "progress.step"),
])
def test_a_state_of_another_run_or_step_is_refused(state5, field, value, message):
    with pytest.raises(StateError, match=message):
        check_consistency(state5, _expected(**{field: value}))


def test_a_history_with_a_skipped_step_is_refused(state5):
    rows = History.from_state_dict(state5["history"]).rows
    hist = History()
    for row in rows[:2] + rows[3:]:
        hist.append(**row)
    state5["history"] = hist.state_dict()
    state5["progress"]["step"] = 4
    with pytest.raises(StateError, match="repeated or skipped"):
        check_consistency(state5, _expected(step=4))


@pytest.mark.parametrize("damage", ["float-steps", "ragged", "bad-offsets"])
def test_a_malformed_history_is_refused(state5, damage):
    h = state5["history"]
    if damage == "float-steps":
        h["step"] = h["step"].double()
    elif damage == "ragged":
        h["loss"] = h["loss"][:-1]
    else:
        h["sample_offsets"] = h["sample_offsets"].flip(0)
    with pytest.raises(StateError, match="history"):
        check_consistency(state5, _expected())


def test_a_scheduler_out_of_step_is_refused(state5):
    state5["scheduler"]["last_epoch"] = 3
    with pytest.raises(StateError, match="scheduler"):
        check_consistency(state5, _expected())


def test_other_library_versions_only_warn(state5):
    state5["meta"]["versions"] = {"torch": "1.0", "numpy": "1.0", "python": "3.0"}
    warnings = check_consistency(state5, _expected())
    assert len(warnings) == 3 and all("bitwise" in w for w in warnings)


# -- generators and data position ------------------------------------------------------------------------

def _draws(np_gen):
    return (random.random(), float(np_gen.random()), float(np.random.random()), float(torch.rand(())))


def test_rng_capture_restore_reproduces_every_generator():
    np_gen = rng.seed_all(3)
    saved = decode_rng(rng.capture(np_gen))
    first = _draws(np_gen)
    rng.seed_all(99)  # scramble every generator
    rng.restore(saved, np_gen)
    assert _draws(np_gen) == first


def decode_rng(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_observing_next_draws_does_not_disturb_the_generators():
    np_gen = rng.seed_all(5)
    observed = rng.observe_next_draws(np_gen)
    actual = _draws(np_gen)
    assert (observed["python"], observed["numpy"], observed["numpy_global"]) == actual[:3]
    np_gen2 = rng.seed_all(5)
    assert _draws(np_gen2) == actual  # the observation left no trace


def test_an_rng_state_missing_a_generator_is_refused():
    state = rng.capture(rng.seed_all(1))
    del state["numpy"]
    with pytest.raises(StateError, match="numpy"):
        rng.restore(state, np.random.Generator(np.random.PCG64(0)))


def test_sampler_draws_each_epoch_lazily_and_resumes_at_the_boundary():
    a = EpochSampler(6, np.random.Generator(np.random.PCG64(1)))
    first_epoch = a.next_ids(4) + a.next_ids(4)
    assert sorted(first_epoch) == list(range(6)) and a.cursor == 6 and a.epoch == 0
    saved = a.state_dict()
    b_gen = np.random.Generator(np.random.PCG64(1))
    b_gen.bit_generator.state = a._gen.bit_generator.state
    b = EpochSampler(6, b_gen)
    b.load_state_dict(saved)
    assert a.next_ids(4) == b.next_ids(4) and b.epoch == 1


@pytest.mark.parametrize("tamper", ["epoch_generator", "generator", "both-from-another-epoch", "drawn"])
def test_a_tampered_data_generator_pair_is_refused(tamper):
    """The saved position holds no permutation: it is redrawn from ``epoch_generator``, which must then land on
    ``generator`` exactly. Any other pair (even one that is internally valid, of another epoch) is refused."""
    s = EpochSampler(4, np.random.Generator(np.random.PCG64(1)))
    s.next_ids(2)
    state = s.state_dict()
    EpochSampler(4, np.random.Generator(np.random.PCG64(9))).load_state_dict(state)  # untouched: loads
    later = EpochSampler(4, np.random.Generator(np.random.PCG64(1)))
    for _ in range(3):
        later.next_ids(2)  # epoch 1: its own (valid) pair
    if tamper == "epoch_generator":
        state["epoch_generator"] = later.state_dict()["epoch_generator"]
    elif tamper == "generator":
        state["generator"] = later.state_dict()["generator"]
    elif tamper == "both-from-another-epoch":  # a consistent pair, but not the one this cursor was drawn from:
        pair = later.state_dict()  # loads (the pair proves itself, not which epoch it is), so the
        state.update(epoch_generator=pair["epoch_generator"], generator=pair["generator"])  # sample ids differ
        restored = EpochSampler(4, np.random.Generator(np.random.PCG64(9)))
        restored.load_state_dict(state)
        assert restored.permutation.tolist() == later.permutation.tolist() != s.permutation.tolist()
        return
    else:
        state["drawn"] = False
    with pytest.raises(StateError, match="generator|permutation"):
        EpochSampler(4, np.random.Generator(np.random.PCG64(9))).load_state_dict(state)


def test_the_data_position_is_the_same_size_for_a_million_samples():
    """O(1): no permutation is stored, whatever the dataset size (it was 8 bytes a sample: 8 MB here)."""
    sizes = {}
    for n in (10, 1_000_000):
        s = EpochSampler(n, np.random.Generator(np.random.PCG64(1)))
        s.next_ids(4)
        state = s.state_dict()
        assert not any(isinstance(v, torch.Tensor) for v in state.values())
        sizes[n] = len(pickle.dumps(state, protocol=2))  # the protocol torch.save pickles with
        restored = EpochSampler(n, np.random.Generator(np.random.PCG64(5)))
        restored.load_state_dict(decode_rng(state))
        assert restored.permutation.tolist() == s.permutation.tolist()
    # Only integer widths differ: num_samples 10 -> 1,000,000 pickles as BININT1 (1 byte) -> BININT (4 bytes), +3;
    # the four 128-bit PCG64 words (state, inc of each generator) pickle as LONG1 with 16 or 17 bytes (17 when the
    # top bit is set), +-1 each.
    assert abs(sizes[1_000_000] - sizes[10] - 3) <= 4, sizes


def test_epoch_plan_keeps_the_tail_and_refuses_a_tail_smaller_than_world():
    assert epoch_plan(37, 8) == {"samples": 37, "global_batch": 8, "steps": 5, "tail": 5, "quarter_steps": [2, 3, 4, 5]}
    with pytest.raises(ConfigError):
        epoch_plan(9, 4, world=2)  # 8 per step: the last step would hold 1 sample for 2 ranks


# -- in-process exact resume -------------------------------------------------------------------------------

@pytest.mark.parametrize(("task", "total", "cut"), [("regression", 10, 6), ("regression", 13, 12), ("tinylm", 7, 5)],
                         ids=["regression-boundary", "regression-second-boundary", "tinylm-boundary"])
def test_resume_at_an_epoch_boundary_is_bitwise_equal(task, total, cut):
    reference = capture_state(_trained(task, total), _meta())
    saved = encode(capture_state(_trained(task, cut), _meta()))
    assert decode(saved)["ranks"][0]["data"]["cursor"] == decode(saved)["ranks"][0]["data"]["num_samples"]
    resumed = build_run(load_task(task), CPU, 7)
    restore_state(resumed, decode(saved))
    for _ in range(total - cut):
        train_step(resumed)
    assert differences(reference, _reassembled(capture_state(resumed, _meta()), decode(saved))) == []


def _reassembled(state: dict, *earlier: dict) -> dict:
    """``state`` with its full history: a resumed run holds only the rows since the state it resumed from, the
    rest is in that (earlier) generation (trainproof.format.history, chain checked)."""
    return assemble(state, {e["progress"]["step"]: e for e in earlier}.get).state


def test_tampered_rng_state_is_caught_by_the_next_draw_check():
    state = decode(encode(capture_state(_trained("regression", 2), _meta())))
    state["ranks"][0]["rng"]["torch"] = torch.manual_seed(123).get_state()
    with pytest.raises(StateError, match="torch"):
        restore_state(build_run(load_task("regression"), CPU, 7), state)


def test_a_model_state_of_another_shape_is_refused():
    state = decode(encode(capture_state(_trained("regression", 1), _meta())))
    with pytest.raises(StateError, match="model"):
        restore_state(build_run(load_task("regression", {"hidden": 9}), CPU, 7), state)


class _AmpTinyLM(TinyLMTask):
    """tinylm with the CUDA-only AMP path (float16 autocast + GradScaler) forced on, so the CPU exercises it."""

    def use_amp(self, device):
        return True


def test_the_amp_gradscaler_path_checkpoints_and_resumes_exactly():
    def amp_run():
        task = _AmpTinyLM(TinyLMConfig())
        configure_determinism(task, CPU)
        return build_run(task, CPU, 3)

    reference = amp_run()
    for _ in range(6):
        train_step(reference)
    cut = amp_run()
    for _ in range(2):
        train_step(cut)
    saved = decode(encode(capture_state(cut, _meta())))
    assert saved["scaler"]["_growth_tracker"] == 2 and saved["scaler"]["scale"] > 1
    resumed = amp_run()
    restore_state(resumed, saved)
    for _ in range(4):
        train_step(resumed)
    assert differences(capture_state(reference, _meta()), _reassembled(capture_state(resumed, _meta()), saved)) == []
    saved["scaler"] = {}
    with pytest.raises(StateError, match="GradScaler"):
        restore_state(amp_run(), saved)


def test_a_state_archive_that_expands_past_its_size_is_refused_before_loading():
    """A zip bomb in a checkpoint's clothing: a small deflated member that expands a thousandfold."""
    import io as _io
    import zipfile as _zip

    from trainproof.format.state import check_archive

    buf = _io.BytesIO()
    torch.save({"a": torch.zeros(1000)}, buf)
    check_archive(buf.getvalue())  # what torch.save writes passes
    bomb = _io.BytesIO()
    with _zip.ZipFile(bomb, "w", compression=_zip.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * 5_000_000)
    assert len(bomb.getvalue()) < 20_000
    with pytest.raises(StateError, match="would expand to 5,000,"):
        decode(bomb.getvalue())


def _members(data: bytes) -> list[tuple]:
    """Each member of a zip archive: its name, header offset, sizes, crc32 and stored bytes."""
    import zipfile as _zip

    out = []
    with _zip.ZipFile(io.BytesIO(data)) as z:
        for m in z.infolist():
            start = m.header_offset + 30 + len(m.filename.encode()) + len(m.extra)  # the local header's fixed part
            local = data[m.header_offset:start]
            extra_len = int.from_bytes(local[28:30], "little")
            name_len = int.from_bytes(local[26:28], "little")
            begin = m.header_offset + 30 + name_len + extra_len
            out.append((m.filename, m.header_offset, m.file_size, m.CRC, data[begin:begin + m.compress_size]))
    return out


def test_the_state_archive_is_torch_saves_without_its_crc32s():
    """``save_archive`` (every state, frozen and rank file) writes what ``torch.save`` writes, member for member
    and byte for byte, but with the crc32 fields zero; ``torch.load`` reads it as it reads torch.save's, mapped or
    not, and torch's own setting is left as it was."""
    from torch import serialization

    from trainproof.format.state import save_archive

    state = capture_state(_trained("tinylm", 2), _meta())
    ours, theirs = io.BytesIO(), io.BytesIO()
    save_archive(state, ours)
    torch.save(state, theirs)
    assert serialization.get_crc32_options() is True
    mine, ref = _members(ours.getvalue()), _members(theirs.getvalue())
    assert len(ours.getvalue()) == len(theirs.getvalue()) and len(mine) == len(ref) > 3
    for (name, offset, size, crc, body), (rname, roffset, rsize, rcrc, rbody) in zip(mine, ref):
        if name.endswith("/serialization_id"):  # torch draws a new one for every save
            body = rbody
        assert (name, offset, size, body) == (rname, roffset, rsize, rbody)
        assert crc == 0 and (rcrc != 0 or not rbody)
    assert differences(state, decode(ours.getvalue())) == []


def test_the_state_archive_is_torch_save_where_torch_internals_differ(monkeypatch):
    """A torch whose private ``_save`` takes other parameters gets ``torch.save`` itself, crc32s included."""
    from torch import serialization

    from trainproof.format.state import save_archive

    real = serialization._save
    monkeypatch.setattr(serialization, "_save", lambda obj, zip_file, pickle_module, pickle_protocol, _d, extra=None:
                        real(obj, zip_file, pickle_module, pickle_protocol, _d))
    state = {"w": torch.arange(1000, dtype=torch.float32), "n": 3}
    ours, theirs = io.BytesIO(), io.BytesIO()
    save_archive(state, ours)
    torch.save(state, theirs)
    assert ours.getvalue() == theirs.getvalue()
    assert all(crc != 0 for _, _, _, crc, _ in _members(ours.getvalue()))


_FAILING_SAVES = """
import errno, gc, sys, torch
from torch import serialization
from trainproof.format.state import encode, encode_spool
from trainproof.storage import spool

state = {f"t{i}": torch.randn(2**20) for i in range(8)}


def attempt(where):
    for save in (lambda: encode_spool(state, sys.argv[1]), lambda: encode(state)):
        try:
            save()
            print(where, "saved", flush=True)
        except (OSError, KeyboardInterrupt) as exc:
            print(where, "raised", type(exc).__name__, flush=True)
        gc.collect()


inner, calls = spool.SpoolWriter._write_out, []
def write_out(self, view):  # a full disk under the spool, at its third write
    calls.append(1)
    if len(calls) == 3:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    return inner(self, view)
spool.SpoolWriter._write_out = write_out
attempt("write")
spool.SpoolWriter._write_out = inner
def location_tag(storage):  # an interrupt while pickling, before anything is written
    raise KeyboardInterrupt
serialization.location_tag = location_tag
attempt("pickle")
print("alive", flush=True)
"""


def test_a_save_failing_midway_raises_its_error_and_the_process_lives_on(tmp_path):
    """An error inside ``save_archive`` (a full disk under the spool, an interrupt while pickling) is raised as itself,
    and the archive writer is ended with it: left to torch's C++ destructor, ending a failed archive killed the
    process (std::terminate, exit 134) instead."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FAILING_SAVES, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["write raised OSError", "write saved", "pickle raised KeyboardInterrupt",
                                        "pickle raised KeyboardInterrupt", "alive"], done.stdout
