"""Frozen snapshots: what a run received from a live web search (a fake Serper on 127.0.0.1),
recorded as one file and served back offline byte for byte; a query it lacks refused in one
line, or fetched live and added to a new file; a damaged file refused in one line; no file
written over that the server did not create."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest
from fake_web_search import fake_web_search
from servers import free_port, running_server

from core.errors import UserError
from retrieval_server.snapshot.file import Snapshot, SnapshotKey, load_snapshot, write_own_file

# (queries, topk, return_scores): what the recorded run asked
RUN = [
    (["who wrote hamlet", "paris"], 3, True),
    (["paris", "rome"], 3, False),
    (["paris"], 5, True),
    (["rome", "who wrote hamlet", "rome"], 3, True),
]


def ask(url: str, queries: list[str], topk: int, scores: bool) -> httpx.Response:
    body = {"queries": queries, "topk": topk, "return_scores": scores}
    return httpx.post(f"{url}/retrieve", json=body, timeout=60)


def web(fake) -> dict:
    return {"url": fake.url, "web": {"api": fake.api}, "max_retries": 0}


def record_run(fake, path: Path) -> list[bytes]:
    """The RUN against `fake` through a server recording to `path`; the response bodies."""
    with running_server(None, upstream=web(fake), snapshot={"record_path": path}) as server:
        bodies = [ask(server.url, *request).content for request in RUN]
    return bodies


def test_a_recorded_run_is_served_back_offline_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "eval.snapshot"
    with fake_web_search("serper") as fake:
        monkeypatch.setenv("SERPER_API_KEY", fake.key)
        recorded = record_run(fake, path)
        fake.generation = 2  # the web has changed since
        with running_server(None, upstream=web(fake), cache={"enabled": False}) as live:
            today = ask(live.url, *RUN[0]).content
        searches = fake.searches
    assert today != recorded[0]  # a live rerun would not be exact
    with running_server(None, snapshot={"path": path}) as server:  # no API anywhere now
        replayed = [ask(server.url, *request) for request in RUN]
        missing = ask(server.url, ["london", "paris"], 3, True)
        report = httpx.get(f"{server.url}/health").json()["snapshot"]
    assert [r.status_code for r in replayed] == [200] * len(RUN)
    assert [r.content for r in replayed] == recorded
    assert [int(r.headers["x-hdr-billed-queries"]) for r in replayed] == [0] * len(RUN)
    assert fake.searches == searches
    detail = missing.json()["detail"]
    assert missing.status_code == 404 and "\n" not in detail
    assert "not in snapshot eval.snapshot" in detail and "'london'" in detail
    assert report["entries"] == 6 and report["missing"] == 1 and report["path"] == str(path)
    header = orjson.loads(path.read_bytes().split(b"\n")[0])
    assert header["backend"]["web"]["api"] == "serper" and header["entries"] == 6
    assert header["backend"]["url"] == fake.url  # shown: no key in it


def test_a_query_the_snapshot_lacks_is_fetched_live_and_added_to_a_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, grown = tmp_path / "eval.snapshot", tmp_path / "grown.snapshot"
    with fake_web_search("serper") as fake:
        monkeypatch.setenv("SERPER_API_KEY", fake.key)
        recorded = record_run(fake, path)
        original = path.read_bytes()
        fake.generation = 2
        searches = fake.searches
        snapshot = {"path": path, "on_miss": "forward", "record_path": grown}
        with running_server(None, upstream=web(fake), snapshot=snapshot) as server:
            old = ask(server.url, *RUN[0])
            new = ask(server.url, ["london", "paris"], 3, False)
    assert old.content == recorded[0]  # from the snapshot, not today's web
    assert new.status_code == 200 and fake.searches == searches + 1  # london alone fetched
    assert (new.headers["x-hdr-billed-queries"], new.headers["x-hdr-cached-queries"]) == ("1", "1")
    assert "generation 2" in new.json()["result"][0][0]["contents"]
    assert path.read_bytes() == original  # the served snapshot is never written
    loaded = load_snapshot(grown)
    assert len(loaded.answers) == 7
    assert SnapshotKey("", 3, False, "london") in loaded.answers


def snapshot_file(path: Path) -> bytes:
    snapshot = Snapshot({"url": "https://google.serper.dev/search", "web": {"api": "serper"}})
    answer = orjson.dumps([{"document": {"id": "a", "contents": '"A"\ntext'}, "score": 1.0}])
    snapshot.add(SnapshotKey("", 3, True, "alpha"), answer, 1.0)
    snapshot.add(SnapshotKey("", 3, False, "beta"), b'[{"id":"b","contents":"\\"B\\"\\nx"}]', 2.0)
    data = snapshot.encode()
    path.write_bytes(data)
    return data


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda data: data.replace(b"alpha", b"alphb"), "do not match the checksum"),
        (lambda data: data[:-10], "do not match the checksum"),
        (lambda data: data.replace(b'"entries":2', b'"entries":3'), "where its header says 3"),
        (lambda data: b'{"kind": "something else"}\n', "is not an hdr search snapshot"),
        (lambda data: b"\x00\x01garbage", "is not an hdr search snapshot"),
    ],
)
def test_a_damaged_snapshot_is_refused_in_one_line(tmp_path: Path, damage, said: str) -> None:
    path = tmp_path / "eval.snapshot"
    data = snapshot_file(path)
    assert len(load_snapshot(path).answers) == 2
    path.write_bytes(damage(data))
    with pytest.raises(UserError) as refused:
        load_snapshot(path)
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_an_answer_that_is_not_a_search_result_makes_the_snapshot_damaged(tmp_path: Path) -> None:
    path = tmp_path / "eval.snapshot"
    snapshot = Snapshot({"url": "x"})
    snapshot.add(SnapshotKey("", 3, True, "alpha"), b'{"a": 1}', 1.0)
    path.write_bytes(snapshot.encode())  # a consistent checksum over a wrong answer
    with pytest.raises(UserError, match="line 2: its answer is not a Search-R1 result list"):
        load_snapshot(path)


def hdr_serve(*args: str) -> subprocess.CompletedProcess:
    hdr = str(Path(sys.executable).with_name("hdr"))
    command = [hdr, "serve", *args, "--port", str(free_port())]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ}, timeout=120)


def test_hdr_serve_refuses_a_damaged_snapshot_and_an_existing_record_path(tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.snapshot"
    damaged.write_bytes(snapshot_file(damaged).replace(b"alpha", b"alphb"))
    refused = hdr_serve("--snapshot", str(damaged))
    taken = tmp_path / "taken.snapshot"
    taken.write_text("a user's file\n")
    kept = hdr_serve("--snapshot", str(tmp_path / "none"), "--record-snapshot", str(taken))
    for result, said in ((refused, "is damaged"), (kept, "exists; hdr records a snapshot only")):
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and said in lines[0], result.stderr
    assert taken.read_text() == "a user's file\n"


def test_a_recording_is_never_written_over_a_file_it_did_not_create(tmp_path: Path) -> None:
    path = tmp_path / "run.snapshot"
    created = write_own_file(path, b"first\n", None)
    created = write_own_file(path, b"second\n", created)  # its own file: replaced
    assert path.read_bytes() == b"second\n"
    other = tmp_path / "other"
    other.write_bytes(b"someone else's\n")
    os.replace(other, path)
    with pytest.raises(UserError, match="moved or replaced since this server created it"):
        write_own_file(path, b"third\n", created)
    assert path.read_bytes() == b"someone else's\n"
    with pytest.raises(UserError, match="exists; hdr records a snapshot only in a new file"):
        write_own_file(path, b"fourth\n", None)
    assert path.read_bytes() == b"someone else's\n"


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"index_dir": "data/index", "snapshot": {"path": "a"}}, "a snapshot is served alone"),
        ({"snapshot": {"path": "a", "on_miss": "forward"}}, "needs a live backend"),
        (
            {
                "upstream": {"url": "http://127.0.0.1:9"},
                "snapshot": {"path": "a", "on_miss": "forward"},
            },
            "give snapshot.record_path",
        ),
        (
            {"upstream": {"url": "http://127.0.0.1:9"}, "snapshot": {"path": "a"}},
            "never asks the live backend",
        ),
        ({"snapshot": {"path": "a", "record_path": "a"}}, "record to a new file"),
    ],
)
def test_what_a_snapshot_is_served_with_is_checked_in_one_line(settings: dict, said: str) -> None:
    from core.config import build_config
    from retrieval_server.config import ServerConfig

    with pytest.raises(UserError) as refused:
        build_config(ServerConfig, settings)
    assert said in str(refused.value) and "\n" not in str(refused.value).strip()
