"""A checkpoint's size does not grow with the run: 3 000 steps of ``regression`` checkpoint to the same size as 10
(``bench/bench_growth.py`` measures 100 000).

In-process through the real trainer (trainproof.train.loop.train: the loop, the background saver, the checkpointer's
commit with its read-back check) into a ``memory://`` store: a real ``trainproof train`` process needs ~75 s for
the 1000 commits of 10 000 steps on a shared 2-core machine, this ~20 s; 3 000 steps keep the suite short).
"""

from __future__ import annotations

import io
import uuid
import zipfile

from trainproof.train.config import TrainConfig
from trainproof.train.loop import train
from trainproof.train.progress import Reporter
from trainproof.format.state import STATE_FILE, decode
from trainproof.storage import open_store

INTERVAL = 10


def _newest_state(steps: int) -> bytes:
    url = f"memory://size-{uuid.uuid4().hex}"
    store = open_store(url)
    cfg = TrainConfig(store=url, max_steps=steps, checkpoint_every=INTERVAL, checkpoint_every_seconds=0, keep=1,
                      log_format="json", log_every=10**6)
    assert train(cfg, store=store, reporter=Reporter()).exit_code == 0
    loaded = store.load_latest()
    assert loaded.info.step == steps
    return loaded.files[STATE_FILE]


def _members(data: bytes) -> dict[str, int]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {m.filename.split("/", 1)[1]: m.file_size for m in z.infolist()}


def test_a_checkpoint_after_3000_steps_is_no_larger_than_after_10():
    short, long = _newest_state(10), _newest_state(3_000)
    state = decode(long)
    assert state["history"]["step"].tolist() == list(range(2_991, 3_001))  # the rows since the previous generation
    assert state["history_chain"]["first"] == 2_991
    a, b = _members(short), _members(long)
    # Every tensor (model, optimizer, the 10 history rows, generator states) has exactly the same size: nothing
    # stored grows with the step count.
    assert {k: v for k, v in a.items() if k != "data.pkl"} == {k: v for k, v in b.items() if k != "data.pkl"}
    # The pickle differs only in integer widths: about twenty counters (step, samples/targets seen, epochs, the
    # scheduler's, max_steps, history_chain.first) move from 1-byte to 2- or 4-byte opcodes (+1 to +3 bytes each),
    # and the 128/32-bit generator words pickle 1 byte longer or shorter with their value. 64 bytes bound that.
    assert abs(b["data.pkl"] - a["data.pkl"]) <= 64, (a["data.pkl"], b["data.pkl"])
    # torch.save aligns every archive record to 64 bytes, so such a pickle moves the file by at most one unit.
    assert len(long) <= len(short) + 64, (len(short), len(long))
