"""`batchwright run` stopped by a signal and run again: nothing lost, nothing twice.

Each test drives the real command in a subprocess. Interrupts are sent while the run is
stopped at a moment its state database holds finished lines (a condition, not a delay)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from batchwright.runs.state import RunState


def _lines(n: int, tag: str = "q") -> str:
    out = []
    for i in range(n):
        body = {"model": "demo", "prompt": f"{tag} {i}: the sea and the {i % 13}", "max_tokens": 4}
        out.append(
            json.dumps(
                {
                    "custom_id": f"{tag}{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {**body, "temperature": 0},
                }
            )
        )
    return "\n".join(out) + "\n"


def _env(home: Path, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWRIGHT_")}
    env["BATCHWRIGHT_HOME"] = str(home)
    # A private temp dir: the run must leave nothing in it.
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    return env


def _cmd(path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "batchwright.cli", "run", str(path), "--quiet", *extra]


def _run(path: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(path, *extra), env=env, capture_output=True, text=True, timeout=600)


def _saved_completions(database: Path) -> dict[str, str]:
    """custom_id -> Completion id of lines the state database holds as done."""
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as conn:
        rows = conn.execute(
            "SELECT r.custom_id, c.id FROM batch_requests r "
            "JOIN completions c ON c.request_row_id = r.id"
        ).fetchall()
    return dict(rows)


def _counts(database: Path) -> tuple[int, int] | None:
    """(finished lines, all lines) in the run's state database; None before it has them."""
    if not database.exists():
        return None
    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE state IN ('succeeded', 'failed')), count(*) "
                "FROM batch_requests"
            ).fetchone()
    except sqlite3.OperationalError:  # not created yet
        return None
    return int(row[0]), int(row[1])


def _frozen_mid_run(database: Path, at_least: int, proc: subprocess.Popen[bytes]) -> None:
    """Leaves the run stopped (SIGSTOP) at a moment its state database holds at least
    `at_least` finished lines, and not all. Once it has lines it runs a millisecond at a time
    between looks taken while it is stopped, so it cannot finish unseen however fast the
    engine (a 300-line run once finished between two looks 0.1 s apart; a result write
    takes at most result_queue_size lines, so the count passes through the middle)."""
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no progress in the state database"
        if _counts(database) is None:
            time.sleep(0.005)
            continue
        proc.send_signal(signal.SIGSTOP)
        counts = _counts(database)
        assert counts is not None
        if counts[0] >= at_least:
            assert counts[0] < counts[1], f"every line finished unseen: {counts}"
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.001)


def _interrupt(
    path: Path, env: dict[str, str], at_least: int, sig: int = signal.SIGINT, times: int = 1
) -> tuple[int, str]:
    database = RunState(Path(env["BATCHWRIGHT_HOME"]), path).database
    # Unbuffered: readline below must not read ahead, or lines it buffered past "stopping"
    # never reach communicate(), which reads the descriptor (lost in a loaded CI run).
    proc = subprocess.Popen(
        _cmd(path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
    )
    _frozen_mid_run(database, at_least, proc)
    proc.send_signal(sig)  # pending while stopped: handled as it goes on
    proc.send_signal(signal.SIGCONT)
    seen = b""
    if times == 2:
        # Signals of one kind coalesce while pending: the second goes once the first is seen.
        assert proc.stderr is not None
        while b"stopping" not in seen and proc.poll() is None:
            seen += proc.stderr.readline()
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, (seen + err).decode()


def _output(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_interrupted_run_continues_where_it_stopped(bw_home: Path, tmp_path: Path) -> None:
    env = _env(bw_home, tmp_path / "tmp")
    text = _lines(600)
    reference, src = tmp_path / "reference.jsonl", tmp_path / "big.jsonl"
    reference.write_text(text)
    src.write_text(text)
    done = _run(reference, env)
    assert done.returncode == 0, done.stderr
    state = RunState(bw_home, src)

    code, err = _interrupt(src, env, at_least=64)
    assert code == 130, err
    stopped = [ln for ln in err.splitlines() if ln.startswith("interrupted at")]
    assert stopped and stopped[0].endswith(
        "of 600 lines; run the same command again to continue"
    ), err
    saved_at = int(stopped[0].split()[2])
    assert 64 <= saved_at < 600
    assert "Traceback" not in err and "terminate called" not in err
    assert not (tmp_path / "big.output.jsonl").exists()
    saved = _saved_completions(state.database)
    assert len(saved) == saved_at

    again = _run(src, env)
    assert again.returncode == 0, again.stderr
    assert f"continuing: {saved_at} of 600 lines already done" in again.stderr
    out, ref = _output(tmp_path / "big.output.jsonl"), _output(tmp_path / "reference.output.jsonl")
    assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(600)]
    # Greedy decoding: the same text as the uninterrupted run, line for line.
    texts = [o["response"]["body"]["choices"][0]["text"] for o in out]  # type: ignore[index]
    assert texts == [o["response"]["body"]["choices"][0]["text"] for o in ref]  # type: ignore[index]
    # Lines finished before the interrupt were not generated again: same Completion ids.
    by_id = {o["custom_id"]: o["response"]["body"]["id"] for o in out}  # type: ignore[index]
    assert all(by_id[cid] == completion for cid, completion in saved.items())
    assert not state.dir.exists()  # removed after success
    assert list((tmp_path / "tmp").iterdir()) == []


def test_second_ctrl_c_exits_at_once_and_state_stays_consistent(
    bw_home: Path, tmp_path: Path
) -> None:
    env = _env(bw_home, tmp_path / "tmp")
    src = tmp_path / "twice.jsonl"
    src.write_text(_lines(300, "t"))
    code, err = _interrupt(src, env, at_least=32, times=2)
    assert code == 130, err
    assert "terminate called" not in err and "Traceback" not in err
    # The second signal exits at once unless the first stop (tens of ms) won the race.
    assert "stopped at once" in err or "run the same command again to continue" in err
    again = _run(src, env)
    assert again.returncode == 0, again.stderr
    assert "continuing:" in again.stderr, (err, again.stderr)
    out = _output(tmp_path / "twice.output.jsonl")
    assert [o["custom_id"] for o in out] == [f"t{i}" for i in range(300)]
    assert not (tmp_path / "twice.errors.jsonl").exists()


def test_changed_input_starts_over_and_state_options(bw_home: Path, tmp_path: Path) -> None:
    env = _env(bw_home, tmp_path / "tmp")
    src = tmp_path / "edit.jsonl"
    src.write_text(_lines(400, "a"))
    state = RunState(bw_home, src)

    code, err = _interrupt(src, env, at_least=32, sig=signal.SIGTERM)
    assert code == 143, err
    assert "run the same command again to continue" in err
    assert state.dir.exists()

    src.write_text(_lines(12, "b"))  # edited since: the saved lines belong to another file
    done = _run(src, env, "--keep-state")
    assert done.returncode == 0, done.stderr
    assert "changed since the interrupted run; starting over" in done.stderr
    assert [o["custom_id"] for o in _output(tmp_path / "edit.output.jsonl")] == [
        f"b{i}" for i in range(12)
    ]
    assert state.dir.exists()  # --keep-state

    out, errors = tmp_path / "custom" / "o.jsonl", tmp_path / "custom" / "e.jsonl"
    out.parent.mkdir()
    errors.write_text("stale\n")
    done = _run(src, env, "--restart", "--output", str(out), "--errors", str(errors))
    assert done.returncode == 0, done.stderr
    assert "discarding the saved state" in done.stderr
    assert len(_output(out)) == 12
    assert not errors.exists()  # a clean run leaves no earlier errors file beside it
    assert not state.dir.exists()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_stale_files_and_failure_summary(bw_home: Path, tmp_path: Path) -> None:
    env = _env(bw_home, tmp_path / "tmp")
    src = tmp_path / "mixed.jsonl"
    good = json.loads(_lines(1).strip())
    bad = [
        {**good, "custom_id": f"bad{i}", "body": {**good["body"], "temperature": 7}}
        for i in range(5)
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in [good, *bad]))
    (tmp_path / "mixed.output.jsonl").write_text("old output\n")
    done = _run(src, env)
    assert done.returncode == 0, done.stderr
    assert [o["custom_id"] for o in _output(tmp_path / "mixed.output.jsonl")] == ["q0"]
    assert len(_output(tmp_path / "mixed.errors.jsonl")) == 5
    assert "failed lines by error code" in done.stdout
    assert "5 lines" in done.stdout and "line 2:" in done.stdout
    assert "and 2 more" in done.stdout

    # A file-level failure leaves no output or errors file from the run before.
    src.write_text(json.dumps(good) + "\nnot json\n")
    failed = _run(src, env)
    assert failed.returncode == 1
    assert "line 2" in failed.stdout and "invalid_json_line" in failed.stdout
    assert not (tmp_path / "mixed.output.jsonl").exists()
    assert not (tmp_path / "mixed.errors.jsonl").exists()


def test_binary_input_gets_one_plain_sentence(bw_home: Path, tmp_path: Path) -> None:
    src = tmp_path / "picture.jsonl"
    src.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    done = _run(src, _env(bw_home, tmp_path / "tmp"))
    assert done.returncode == 1
    assert "line 1 is not UTF-8 text — is this a JSONL file?" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
