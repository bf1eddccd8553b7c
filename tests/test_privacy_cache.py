"""The privacy cache (`dpfedavg.privacy.cache`): one parse per process, batched writes, no key lost across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dpfedavg.privacy import cache

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def disk(tmp_path: Path, monkeypatch) -> Path:
    """A fresh cache folder, nothing in memory before or after."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "privacy"))
    cache.clear_memory()
    yield cache.cache_file()
    cache.clear_memory()


def _disk_values(path: Path) -> dict[str, float]:
    return json.loads(path.read_text())["values"]


def _counting(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_the_file_is_parsed_once_per_process_and_again_only_when_it_changed(disk: Path, monkeypatch) -> None:
    for k in range(1, 301):  # a run's epsilon after k rounds, as the accountant asks every round
        cache.cached("eps", (0.5, 1.1, k), lambda k=k: k / 7)
    cache.clear_memory()  # writes them; a new process
    loads = _counting(monkeypatch, cache, "_load")
    fail = lambda: pytest.fail("recomputed")  # noqa: E731
    assert [cache.cached("eps", (0.5, 1.1, k), fail) for k in range(1, 301)] == [k / 7 for k in range(1, 301)]
    assert len(loads) == 1
    # another process adds a key: read again once, at the first key this process does not know
    values = _disk_values(disk)
    values['other[1]'] = 2.5
    time.sleep(0.01)  # a new modification time even on a coarse clock (the size changes anyway)
    disk.write_text(json.dumps({"code": "x", "values": values}))
    assert cache.cached("eps", (0.5, 1.1, 7), fail) == 1.0 and len(loads) == 1
    assert cache.cached("other", (1,), fail) == 2.5 and len(loads) == 2
    # a key nobody has: computed, without reading the unchanged file again; written later (by flush())
    monkeypatch.setattr(cache, "_last_write", time.monotonic())
    monkeypatch.setattr(cache, "FLUSH_SECONDS", 1e9)
    assert cache.cached("eps", (0.5, 1.1, 301), lambda: 43.0) == 43.0 and len(loads) == 2
    assert "eps[0.5, 1.1, 301]" not in _disk_values(disk)
    cache.flush()
    assert _disk_values(disk)["eps[0.5, 1.1, 301]"] == 43.0 and _disk_values(disk)["other[1]"] == 2.5


def test_new_keys_are_written_in_batches_and_all_by_flush(disk: Path, monkeypatch) -> None:
    writes = _counting(monkeypatch, __import__("dpfedavg.io.atomic", fromlist=["x"]), "atomic_write_bytes")
    monkeypatch.setattr(cache, "FLUSH_KEYS", 10)
    monkeypatch.setattr(cache, "FLUSH_SECONDS", 1e9)
    assert cache.cached("eps", (0,), lambda: 0.5) == 0.5  # the first key of a process: written at once
    assert len(writes) == 1 and _disk_values(disk) == {"eps[0]": 0.5}
    for k in range(1, 26):
        cache.cached("eps", (k,), lambda k=k: k + 0.5)
    assert len(writes) == 3  # 10 and 10 more; 5 wait
    assert len(_disk_values(disk)) == 21
    cache.flush()
    assert len(writes) == 4 and _disk_values(disk) == {f"eps[{k}]": k + 0.5 for k in range(26)}
    cache.flush()  # nothing waiting: nothing written
    assert len(writes) == 4


def test_a_write_keeps_what_another_process_wrote_and_a_corrupt_file_is_replaced(disk: Path, monkeypatch) -> None:
    monkeypatch.setattr(cache, "FLUSH_SECONDS", 1e9)
    cache.cached("mine", (1,), lambda: 1.0)
    cache.cached("mine", (2,), lambda: 2.0)  # waits
    values = _disk_values(disk)
    disk.write_text(json.dumps({"code": "x", "values": {**values, "theirs[1]": 3.0}}))
    cache.flush()
    assert _disk_values(disk) == {"mine[1]": 1.0, "mine[2]": 2.0, "theirs[1]": 3.0}
    disk.write_text('{"code": "x", "values": {"mine[1]": 1.0, "min')  # what a crash mid-write could leave
    cache.clear_memory()
    assert cache.cached("mine", (1,), lambda: 1.0) == 1.0  # recomputed, never a wrong value
    cache.flush()
    assert _disk_values(disk) == {"mine[1]": 1.0}
    assert not list(disk.parent.glob("*.tmp"))


WORKER = """
from dpfedavg.privacy import cache

def run(j):
    cache.FLUSH_KEYS, cache.FLUSH_SECONDS = 7, 1e9
    for i in range(52):  # 1 written at once, 7 batches of 7, 2 left for the worker's exit
        cache.cached("t", (j, i), lambda: j * 1000.0 + i)
"""


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_two_worker_processes_write_every_key_at_exit_and_lose_none(start: str, tmp_path: Path) -> None:
    """Two ``multiprocessing`` workers, as a sweep's ``--jobs 2`` (spawn); a forked one ends by ``os._exit``."""
    (tmp_path / "cache_worker.py").write_text(WORKER)
    script = textwrap.dedent(f"""
        import multiprocessing, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import cache_worker
        if __name__ == "__main__":
            context = multiprocessing.get_context({start!r})
            workers = [context.Process(target=cache_worker.run, args=(j,)) for j in (1, 2)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            sys.exit(max(w.exitcode for w in workers))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), cache.CACHE_ENV: str(tmp_path / "privacy")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (path,) = (tmp_path / "privacy").glob("*.json")
    expected = {f"t[{j}, {i}]": j * 1000.0 + i for j in (1, 2) for i in range(52)}
    assert _disk_values(path) == expected


def test_prefetched_epsilons_are_the_accountants_own_and_computed_once(disk: Path, monkeypatch) -> None:
    """`PldAccountant.prefetch()` computes each round's epsilon in a thread: the accountant then reads the same
    values (bit for bit those computed in the caller), and no key is computed twice (a caller asking for a key
    the thread is computing waits for it)."""
    import threading

    from dpfedavg.privacy import accountants
    from dpfedavg.privacy.accountants import PldAccountant, RoundEvent

    event, rounds = RoundEvent(0.05, 1.3), 6
    fresh = PldAccountant(1e-5)
    expected = []
    for _ in range(rounds):
        fresh.step(event)
        expected.append(fresh.epsilon)
    cache.clear_memory()
    monkeypatch.setenv(cache.CACHE_ENV, str(disk.parent / "second"))  # a cold cache again
    computed: list[tuple] = []
    slow = threading.Event()
    original = accountants._pld_epsilon

    def counted(key: tuple) -> float:
        computed.append(key)
        slow.wait(0.05)  # let the round loop catch up with the thread
        return original(key)

    monkeypatch.setattr(accountants, "_pld_epsilon", counted)
    accountant = PldAccountant(1e-5)
    ahead = accountant.prefetch(event, rounds)
    got = []
    for _ in range(rounds):
        accountant.step(event)
        got.append(accountant.epsilon)
    ahead.thread.join(30)
    assert got == expected
    assert sorted(k[2] for k in computed) == list(range(1, rounds + 1))  # each count once, by either thread
    assert accountant.prefetch(RoundEvent(0.1, 1.3), 3) is None  # another event than the rounds so far
