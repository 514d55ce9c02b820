"""``produce --dataset`` reads what TRL users hold their prompts in: a ``datasets`` directory
(``save_to_disk``), Parquet and Arrow files, besides JSONL; TRL's ``prompt`` column as a string
(standard) or chat messages (conversational); other column names mapped. A bad row is
dead-lettered with its index and why, and every other row is pushed."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pytest

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.local.pipeline import xrange_all
from streamrl.producer.datasets import DatasetError, open_rows
from streamrl.producer.produce import Producer
from streamrl.verifiers.reward_functions import STANDARD_PROMPT
from tests.support.cli import run_cli

GOOD = [
    {"prompt": "What is 1 + 1?", "ground_truth": "2"},
    {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "ground_truth": "4"},
]


def _dataset(rows: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows)


def _tasks(r, run: str) -> dict[str, schema.Task]:
    out = {}
    for _, f in xrange_all(r, Keys(run).tasks):
        t = schema.TASK.decode(f[b"p"])
        out.setdefault(t.prompt_id, t)
    return out


def _dead(r, run: str) -> list[str]:
    return sorted(
        schema.DEAD_LETTER.decode(f[b"p"]).reason for _, f in xrange_all(r, Keys(run).dead)
    )


def _save(kind: str, ds: datasets.Dataset, tmp_path):
    """The dataset written the way ``kind`` says; returns the path to give --dataset."""
    if kind == "save_to_disk":
        ds.save_to_disk(str(tmp_path / "ds"))
        return tmp_path / "ds"
    if kind == "parquet":
        ds.to_parquet(str(tmp_path / "ds.parquet"))
        return tmp_path / "ds.parquet"
    if kind == "arrow-stream":  # the cache file `datasets` itself writes (IPC stream)
        ds.save_to_disk(str(tmp_path / "saved"))
        (arrow,) = (tmp_path / "saved").glob("*.arrow")
        return arrow
    if kind == "arrow-file":  # an Arrow IPC file written with pyarrow
        path = tmp_path / "ds.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, ds.data.table.schema) as w:
            w.write_table(ds.data.table)
        return path
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["save_to_disk", "parquet", "arrow-stream", "arrow-file"])
def test_each_format_pushes_standard_and_conversational_prompts(r, tmp_path, kind):
    # one column of one type: the standard rows here, the conversational ones below
    std = [{"prompt": f"What is {i} + {i}?", "ground_truth": str(2 * i)} for i in range(3)]
    bad = [{"prompt": None, "ground_truth": "0"}, {"prompt": " ", "ground_truth": "0"}]
    path = _save(kind, _dataset(std + bad + std[:1]), tmp_path)
    run = f"ds-{kind}"
    res = Producer(r, run).from_rows(open_rows(path), "chat", 2, standard_prompts=True)
    assert res.prompts == 4 and res.samples == 8
    tasks = _tasks(r, run)
    first = tasks[f"{path.stem}-0000001"]
    assert first.input == [schema.Message(role="user", content="What is 0 + 0?")]
    assert first.data == {"ground_truth": "0", STANDARD_PROMPT: True} and first.env == "chat"
    name = path.name
    assert sorted(res.rejected) == [
        f"{name}[3]: no prompt: need responses_create_params.input, input or prompt",
        f"{name}[4]: empty prompt: no message with text",
    ]
    assert _dead(r, run) == sorted(res.rejected)

    conv = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
            "answer": a,
            "uid": f"u{i}",
        }
        for i, (q, a) in enumerate([("Capital of France?", "Paris"), ("2 + 3?", "5")])
    ]
    conv.append({"prompt": [{"role": "user", "content": ""}], "answer": "x", "uid": "u9"})
    conv.append({"prompt": [{"role": "user", "content": "Again?"}], "answer": "y", "uid": "u0"})
    sub = tmp_path / "conv"
    sub.mkdir()
    path = _save(kind, _dataset(conv), sub)
    rows = open_rows(path, columns={"id": "uid", "ground_truth": "answer"})
    res = Producer(r, run + "-conv").from_rows(rows, "chat", 1, standard_prompts=True)
    tasks = _tasks(r, run + "-conv")
    assert sorted(tasks) == ["u0", "u1"]
    assert tasks["u0"].input == [
        schema.Message(role="system", content="Be brief."),
        schema.Message(role="user", content="Capital of France?"),
    ]
    assert tasks["u0"].data == {"ground_truth": "Paris"}  # no standard mark: messages
    assert sorted(res.rejected) == [
        f"{path.name}[2]: empty prompt: no message with text",
        f"{path.name}[3]: id 'u0' is already used on row 0",
    ]


def test_a_restarted_producer_continues_a_dataset_and_keeps_its_ids(r, tmp_path):
    rows = [{"prompt": f"q{i}", "id": f"same-{i % 3}"} for i in range(5)]
    path = _save("parquet", _dataset(rows), tmp_path)
    first = Producer(r, "resume", batch_samples=2).from_rows(open_rows(path, limit=2), "chat", 1)
    assert first.prompts == 2
    res = Producer(r, "resume", batch_samples=2).from_rows(open_rows(path), "chat", 1)
    assert res.skipped == 2 and res.prompts == 1
    assert sorted(res.rejected) == [
        "ds.parquet[3]: id 'same-0' is already used on row 0",
        "ds.parquet[4]: id 'same-1' is already used on row 1",
    ]


def test_splits_and_unreadable_files_are_one_clear_error(tmp_path):
    dd = datasets.DatasetDict({"train": _dataset(GOOD[:1]), "test": _dataset(GOOD[:1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match="holds the splits test, train: give --split"):
        open_rows(tmp_path / "dd")
    assert len(open_rows(tmp_path / "dd", split="test")) == 1
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        open_rows(tmp_path / "junk.parquet")
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    with pytest.raises(DatasetError, match="not an Arrow IPC file or stream"):
        open_rows(tmp_path / "junk.arrow")
    (err,) = open_rows(
        _save("parquet", _dataset(GOOD[:1]), tmp_path), {"prompt": "question"}
    ).fetch(0, 1)
    assert isinstance(err, ValueError) and "no column 'question'" in str(err)  # that row's error


def test_produce_command_maps_columns_and_names_bad_rows(redis_url, r, subprocess_env, tmp_path):
    rows = [
        {"question": "Name a prime.", "uid": "a", "answer": "2"},
        {"question": None, "uid": "b", "answer": "3"},
    ]
    _dataset(rows).save_to_disk(str(tmp_path / "qa"))
    argv = ["--redis", redis_url, "--run", "cli-ds", "produce", "--dataset", str(tmp_path / "qa")]
    argv += ["--env", "chat", "--group-size", "2", "--prompt-column", "question"]
    argv += ["--column", "id=uid", "--column", "ground_truth=answer"]
    refused = run_cli(argv, subprocess_env)
    assert refused.returncode != 0
    assert "environment 'chat' is scored by reward functions" in refused.stderr
    done = run_cli([*argv, "--verifier", "tests.support.trl_rewards:reward_func"], subprocess_env)
    assert done.returncode == 0, done.stderr
    assert "pushed 1 prompts (2 samples)" in done.stdout and "1 rows rejected" in done.stdout
    assert "rejected qa[1]: no prompt" in done.stderr
    task = _tasks(r, "cli-ds")["a"]
    assert task.data == {"ground_truth": "2", STANDARD_PROMPT: True}
    bad = run_cli([*argv, "--verifier", "tests.support.trl_rewards:nope"], subprocess_env)
    assert bad.returncode != 0 and "has no 'nope'" in bad.stderr
