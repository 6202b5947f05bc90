"""Text read from the store reaches the terminal escaped: rich markup is not interpreted, control characters
never pass (a writer of the bucket must not be able to crash ``ls`` or drive the terminal)."""

from __future__ import annotations

import json

from tests.test_train_helpers import run
from tests.test_verify_helpers import cli  # noqa: F401  (a fixture)

HOSTILE = "[/x] [bold red]boom[/] \x1b[2J\x1b]0;owned\x07 \x00end"


def test_ls_shows_hostile_reason_and_latest_text_as_text(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one line per row: the checks below read whole cells
    store = tmp_path / "run"
    assert run(store, "--max-steps", "2").code == 0
    q = store / "quarantine" / "step-00000009-planted"
    q.mkdir(parents=True)
    (q / "REASON").write_text(json.dumps({"reason": HOSTILE}))
    (store / "LATEST").write_text(HOSTILE)
    result = cli("ls", "--store", str(store))
    assert result.exit_code == 0, result.output + str(result.exception)
    assert "\x1b" not in result.output and "\x07" not in result.output and "\x00" not in result.output
    text = " ".join(result.output.split())
    assert "[/x] [bold red]boom[/]" in text  # shown literally, not interpreted
    assert "quarantine/step-00000009-planted" in text
