"""One bad row costs one row: every row of a dataset that cannot be read is dead-lettered with
its line number and reason, and every other row is pushed. These rows used to crash the whole
file before anything was pushed (a non-UTF-8 byte, deep nesting, content parts of the wrong
shape) or to be taken silently (empty prompts, a second row with an id already used)."""

from __future__ import annotations

import json

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.local.pipeline import xrange_all
from streamrl.producer.produce import Producer
from tests.support.cli import run_cli


def _j(row: object) -> bytes:
    return json.dumps(row).encode()


GOOD = b'{"prompt": "Reverse the word stream.", "id": "good-1"}'
# (line content, the reason the dead letter must give); None: a good row
ROWS: list[tuple[bytes, str | None]] = [
    (b"\xef\xbb\xbf" + GOOD, None),  # a byte order mark on the first line is dropped
    (b'{"prompt": "caf\xe9"}', "not UTF-8: byte 0xe9"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (_j({"input": [{"role": "user", "content": [7]}]}), "content parts must be objects"),
    (_j({"input": [{"role": "user", "content": [{"text": 7}]}]}), "content parts must be"),
    (_j({"prompt": ""}), "empty prompt"),
    (_j({"prompt": "   \t "}), "empty prompt"),
    (_j({"input": [{"role": "user", "content": [{"type": "input_text", "text": " "}]}]}), "empty"),
    (_j({"prompt": "Another good one.", "id": "good-2"}) + b"\r", None),  # CRLF line end
    (_j({"prompt": "Same id again.", "id": "good-1"}), "id 'good-1' is already used on line 1"),
    (b"{not json", "not JSON"),
    (_j({"responses_create_params": {"input": "A NeMo Gym row."}}), None),
]


def _write(tmp_path) -> tuple:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(line for line, _ in ROWS) + b"\n")
    return path


def _dead(r, run: str) -> list[schema.DeadLetter]:
    return [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(r, Keys(run).dead)]


def test_each_bad_row_is_dead_lettered_and_every_good_row_pushed(r, tmp_path):
    path = _write(tmp_path)
    res = Producer(r, "rows").from_jsonl(path, "copy", 2)
    good = [i for i, (_, why) in enumerate(ROWS) if why is None]
    bad = {i + 1: why for i, (_, why) in enumerate(ROWS) if why is not None}
    assert res.prompts == len(good) and res.samples == 2 * len(good)
    assert len(res.rejected) == len(bad)
    for line, why in bad.items():
        (reason,) = [x for x in res.rejected if x.startswith(f"rows.jsonl:{line}: ")]
        assert why in reason, (line, reason)
    dead = _dead(r, "rows")
    assert sorted(d.reason for d in dead) == sorted(res.rejected)
    assert all(d.stage == "produce" and d.payload for d in dead)
    prompts = {schema.TASK.decode(f[b"p"]).prompt_id for _, f in xrange_all(r, Keys("rows").tasks)}
    assert prompts == {"good-1", "good-2", "rows-0000012"}


def test_a_restarted_producer_still_knows_the_ids_it_pushed(r, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(GOOD + b"\n")
    assert Producer(r, "again").from_jsonl(path, "copy", 2).prompts == 1
    path.write_bytes(GOOD + b"\n" + _j({"prompt": "Later row, same id.", "id": "good-1"}) + b"\n")
    res = Producer(r, "again").from_jsonl(path, "copy", 2)
    assert res.skipped == 1 and res.prompts == 0
    assert res.rejected == ["rows.jsonl:2: id 'good-1' is already used on line 1"]


def test_produce_command_reports_bad_rows_and_exits_zero(redis_url, r, subprocess_env, tmp_path):
    path = _write(tmp_path)
    argv = ["--redis", redis_url, "--run", "cli-rows", "produce", "--dataset", str(path)]
    done = run_cli([*argv, "--env", "copy", "--group-size", "2"], subprocess_env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert r.xlen(Keys("cli-rows").tasks) == 2 * 3
    assert len(_dead(r, "cli-rows")) == sum(1 for _, why in ROWS if why is not None)


def test_count_with_a_dataset_reads_that_many_lines(redis_url, r, subprocess_env, tmp_path):
    """``--count N`` with ``--dataset`` used to be ignored; it now reads the first N lines, and
    a later run with a larger N goes on from where the first stopped."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(5)))
    argv = ["--redis", redis_url, "--run", "cli-count", "produce", "--dataset", str(path)]
    for count, pushed in ((2, 2), (4, 2), (4, 0)):
        done = run_cli([*argv, "--env", "copy", "--group-size", "1", "--count", str(count)],
                       subprocess_env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"pushed {pushed} prompts" in done.stdout, done.stdout
    prompts = [schema.TASK.decode(f[b"p"]).input for _, f in xrange_all(r, Keys("cli-count").tasks)]
    assert [p[0].content for p in prompts] == [f"row {i}" for i in range(4)]
