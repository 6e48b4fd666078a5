"""Corpora that change: delete (tombstones), update (delete + append), compact, subset= filters,
leftovers of interrupted writes, and writers killed at every step (the folder then loads as the
corpus before or after the write, never between).

Tokens are small integers (int8 / fp8 corpora: a column at the format's largest value, so the
scale is 1), so every score is exact and a search equals its oracle bit for bit."""

import json
import os
import shutil
import signal
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import maxsim
from maxsim.search import Corpus
from maxsim.search import changes
from maxsim.search import format as corpus_format
from maxsim.search.stream import search_corpus
from maxsim.search.topk import merge_topk

D = 8
_LARGEST = {"int8": 127, "fp8": 448}  # a token holding it gets scale 1


def int_docs(n, encoding=None, longest=6):
    """n documents of 0 .. longest - 1 integer tokens (exact in every encoding used here)."""
    small = 8 if encoding == "fp8" else 3
    docs = []
    for L in torch.randint(0, longest, (n,)).tolist():
        x = torch.randint(-small, small + 1, (L, D)).float()
        if encoding in _LARGEST:
            x[:, 0] = _LARGEST[encoding] * (torch.randint(0, 2, (L,)) * 2 - 1)
        docs.append(x)
    return docs


def int_queries(n=4):
    return [torch.randint(-3, 4, (int(L), D)).float() for L in torch.randint(1, 5, (n,))]


def oracle(queries, docs, candidates, k):
    """Top-k over the candidate positions only, by (score desc, position asc): ``(scores [Nq, k'],
    positions [Nq, k'])`` from one maxsim_varlen call on the candidates."""
    positions = np.flatnonzero(candidates)
    if positions.size == 0:
        return torch.empty(len(queries), 0), torch.empty(len(queries), 0, dtype=torch.int64)
    full = maxsim.maxsim_varlen(queries, [docs[j] for j in positions])
    values, order = torch.sort(full, stable=True, dim=-1, descending=True)
    return values[:, :k], torch.from_numpy(positions)[order[:, :k]]


def assert_oracle(result, want, ids):
    assert torch.equal(result.indices, want[1]) and torch.equal(result.scores, want[0])
    got = result.ids.tolist() if isinstance(result.ids, torch.Tensor) else result.ids
    assert got == [[ids[j] for j in row] for row in want[1].tolist()]


def listed(directory: Path) -> set:
    manifest = json.loads((directory / "manifest.json").read_text())
    return {f["name"] for s in manifest["segments"] for f in s["files"].values()} | {"manifest.json"}


def searched(corpus, queries, k=6):
    """What a search answers, independent of positions: (scores, ids, live count)."""
    if corpus.encoding.exact:
        queries = [q.to(corpus.dtype) for q in queries]
    r = corpus.search(queries, k, progress=False, device="cpu")
    ids = r.ids.tolist() if isinstance(r.ids, torch.Tensor) else r.ids
    return r.scores, ids, corpus.num_live


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]


# ---------------------------------------------------------------------------------------------
# delete, update, subset


def small_budget(queries, k):
    """A gpu_memory that holds the top-k state and a chunk of a few dozen documents: many chunks."""
    return 36 * len(queries) * k + sum(q.numel() * 4 for q in queries) + 2000


@pytest.mark.parametrize("small", [False, True])
def test_delete_then_search_equals_the_oracle_on_the_live_documents(small):
    for _ in range(3):  # three draws a run
        docs, more = int_docs(40), int_docs(25)
        queries = int_queries()
        ids = [f"doc-{j}" for j in range(65)]
        corpus = Corpus.from_list(docs, ids=ids[:40]).append(more, ids=ids[40:])  # two segments
        live = np.ones(65, dtype=bool)
        gone = np.random.choice(65, size=int(np.random.randint(1, 40)), replace=False)
        assert corpus.delete([ids[j] for j in gone]) == gone.size
        live[gone] = False
        assert corpus.num_deleted == gone.size and corpus.num_live == live.sum() and len(corpus) == 65
        assert np.array_equal(corpus.live, live)
        for k in (1, 7, int(live.sum()), 200):  # 200: more than the live documents
            budget = small_budget(queries, k) if small else None
            result = corpus.search(queries, k, gpu_memory=budget, batch_size=2, progress=False, device="cpu")
            assert result.scores.shape == (len(queries), min(k, int(live.sum())))
            assert_oracle(result, oracle(queries, docs + more, live, k), ids)
        budget = small_budget(queries[:1], 5) if small else None
        one = corpus.search(queries[0], 5, gpu_memory=budget, progress=False, device="cpu")  # [Lq, d] query
        want = oracle(queries[:1], docs + more, live, 5)
        assert torch.equal(one.indices, want[1][0]) and torch.equal(one.scores, want[0][0])
    # Deleting everything: no result, whatever k.
    assert corpus.delete(ids, missing="ignore") == int(live.sum())
    empty = corpus.search(queries, 5, progress=False, device="cpu")
    assert empty.scores.shape == (len(queries), 0) and empty.ids == [[] for _ in queries]


def test_shards_skip_deleted_documents_and_merge_to_the_whole_answer():
    docs, queries = int_docs(50), int_queries(3)
    corpus = Corpus.from_list(docs)  # int ids 0 .. 49
    gone = np.random.choice(50, size=20, replace=False)
    corpus.delete(torch.from_numpy(gone))
    live = corpus.live
    want = oracle(queries, docs, live, 9)
    for world in (2, 3):
        parts = [search_corpus(corpus.shard(r, world), queries, 9, progress=False, device="cpu") for r in range(world)]
        assert all(s.shard_info[2] == live.sum() for s in (corpus.shard(r, world) for r in range(world)))
        scores, indices = merge_topk(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1), 9)
        assert torch.equal(indices, want[1]) and torch.equal(scores, want[0])


def test_delete_errors_ids_and_repeats():
    corpus = Corpus.from_list(int_docs(12), ids=[f"d{j}" for j in range(12)])
    with pytest.raises(ValueError, match=r"2 id\(s\).*'nope', 'gone'.*missing='ignore'"):
        corpus.delete(["d1", "nope", "gone"])
    assert corpus.num_deleted == 0  # nothing deleted on an error
    assert corpus.delete(["d1", "nope"], missing="ignore") == 1
    assert corpus.delete("d1") == 0 and corpus.delete(["d2", "d2"]) == 1  # again / twice: counted once
    assert corpus.num_deleted == 2
    with pytest.raises(ValueError, match=r"4 id\(s\).*'a', 'b', 'c' and 1 more"):
        corpus.delete(["a", "b", "c", "e", "d0"])
    with pytest.raises(TypeError, match="str ids"):
        corpus.delete([3])
    with pytest.raises(ValueError, match="missing must be"):
        corpus.delete(["d0"], missing="skip")
    numbered = Corpus.from_list(int_docs(6))
    with pytest.raises(TypeError, match="int ids"):
        numbered.delete(["1"])
    assert numbered.delete(np.array([1, 4])) == 2 and numbered.delete(torch.tensor([4, 5])) == 1


@pytest.mark.parametrize("int_ids", [False, True])
def test_an_update_is_delete_then_append(tmp_path, int_ids):
    docs, queries = int_docs(20), int_queries()
    ids = list(range(100, 120)) if int_ids else [f"d{j}" for j in range(20)]
    corpus = Corpus.from_list(docs, ids=ids)
    j = int(np.random.randint(20))
    new = int_docs(1, longest=7)
    new[0] = torch.cat([new[0], torch.full((1, D), 3.0)])  # not empty, unlike any old document
    with pytest.raises(ValueError, match=r"already in the corpus.*delete it first"):
        corpus.append(new, ids=[ids[j]])
    assert len(corpus) == 20  # unchanged by the refused append
    corpus.delete([ids[j]])
    corpus.append(new, ids=[ids[j]])
    all_docs, all_ids = docs + new, ids + [ids[j]]
    live = np.ones(21, dtype=bool)
    live[j] = False
    want = oracle(queries, all_docs, live, 21)
    assert_oracle(corpus.search(queries, 21, progress=False, device="cpu"), want, all_ids)
    # Saved (the id twice: once deleted, once live) and loaded back; updated again on disk.
    corpus.save(tmp_path / "c")
    loaded = Corpus.load(tmp_path / "c")
    assert loaded.num_deleted == 1
    assert_oracle(loaded.search(queries, 21, progress=False, device="cpu"), want, all_ids)
    newer = int_docs(1)
    loaded.delete(ids[j])
    loaded.append(newer, ids=[ids[j]])
    loaded.save(tmp_path / "c", overwrite=True)
    live = np.append(live, True)
    live[20] = False
    assert_oracle(Corpus.load(tmp_path / "c").search(queries, 22, progress=False, device="cpu"),
                  oracle(queries, all_docs + newer, live, 22), all_ids + [ids[j]])
    # An append to the file brings a deleted id back; a live one is refused, naming delete.
    k = (j + 1) % 20
    on_disk = Corpus.load(tmp_path / "c")
    on_disk.delete(ids[k])
    on_disk.save(tmp_path / "c", overwrite=True)
    Corpus.from_list(int_docs(1), ids=[ids[k]]).save(tmp_path / "c", append=True)
    assert Corpus.load(tmp_path / "c").num_live == 20
    with pytest.raises(ValueError, match="delete it first"):
        Corpus.from_list(int_docs(1), ids=[ids[k]]).save(tmp_path / "c", append=True)
    Corpus.from_list(docs, ids=ids).save(tmp_path / "plain")  # no tombstones: format.py's append refuses it
    with pytest.raises(ValueError, match=r"already in corpus.*delete it first"):
        Corpus.from_list(int_docs(1), ids=[ids[k]]).save(tmp_path / "plain", append=True)


def test_an_appended_corpus_brings_its_deletions(tmp_path):
    first, second, queries = int_docs(15), int_docs(15), int_queries()
    ids = [f"a{j}" for j in range(15)] + [f"b{j}" for j in range(15)]
    gone = np.random.choice(15, size=5, replace=False)
    other = Corpus.from_list(second, ids=ids[15:])
    other.delete([ids[15 + j] for j in gone])
    live = np.ones(30, dtype=bool)
    live[15 + gone] = False
    want = oracle(queries, first + second, live, 30)
    in_memory = Corpus.from_list(first, ids=ids[:15]).append(other)
    assert in_memory.num_deleted == 5
    assert_oracle(in_memory.search(queries, 30, progress=False, device="cpu"), want, ids)
    renamed = [f"c{j}" for j in range(15)]
    again = Corpus.from_list(first, ids=ids[:15]).append(other, ids=renamed)  # new ids, same deletions
    assert_oracle(again.search(queries, 30, progress=False, device="cpu"), want, ids[:15] + renamed)
    Corpus.from_list(first, ids=ids[:15]).save(tmp_path / "c")
    other.save(tmp_path / "c", append=True)  # its tombstones in the same commit as its segment
    loaded = Corpus.load(tmp_path / "c")
    assert_oracle(loaded.search(queries, 30, progress=False, device="cpu"), want, ids)
    with pytest.raises(ValueError, match=r"overwrite=True\) writes its changes"):
        loaded.save(tmp_path / "c", append=True)


@pytest.mark.parametrize("int_ids", [False, True])
def test_subset_search_equals_the_oracle_restricted_to_it(int_ids):
    docs, more, queries = int_docs(30), int_docs(30), int_queries()
    ids = list(range(7, 67)) if int_ids else [f"t{j}" for j in range(60)]
    corpus = Corpus.from_list(docs, ids=ids[:30]).append(more, ids=ids[30:])
    gone = np.random.choice(60, size=10, replace=False)
    corpus.delete([ids[j] for j in gone])
    for size in (0, 1, 5, 25, 60):
        chosen = np.random.choice(60, size=size, replace=False)
        unknown = [1000, 1001] if int_ids else ["elsewhere", "t999"]  # ids the corpus never held: ignored
        subset = [ids[j] for j in chosen] + unknown
        candidates = np.zeros(60, dtype=bool)
        candidates[chosen] = True
        candidates[gone] = False  # a deleted document is never a candidate
        for k in (3, 100):
            given = torch.tensor(subset) if int_ids else subset
            result = corpus.search(queries, k, gpu_memory=small_budget(queries, k), progress=False, device="cpu",
                                   subset=given)
            assert_oracle(result, oracle(queries, docs + more, candidates, k), ids)
    with pytest.raises(TypeError, match="subset must be"):
        corpus.search(queries, 3, progress=False, device="cpu", subset=["t1"] if int_ids else [1])


# ---------------------------------------------------------------------------------------------
# files


def test_tombstones_round_trip_and_only_they_are_written(tmp_path):
    docs, more, queries = int_docs(30), int_docs(20), int_queries()
    ids = [f"d{j}" for j in range(50)]
    corpus = Corpus.from_list(docs, ids=ids[:30])
    corpus.delete(["d3", "d4"])
    corpus.save(tmp_path / "c")  # a new corpus with its tombstones, one commit
    Corpus.from_list(more, ids=ids[30:]).save(tmp_path / "c", append=True)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["tombstones"] == changes.TOMBSTONE_VERSION and manifest["version"] == 4  # older readers refuse it
    assert [s.get("num_deleted") for s in manifest["segments"]] == [2, None]
    for mmap in (True, False):
        loaded = Corpus.load(tmp_path / "c", mmap=mmap)
        assert loaded.num_deleted == 2 and loaded.is_mapped == mmap
    live = np.ones(50, dtype=bool)
    live[[3, 4]] = False
    assert_oracle(loaded.search(queries, 50, progress=False, device="cpu"), oracle(queries, docs + more, live, 50), ids)

    # A tombstone-only change: one small file, the token files untouched.
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c").iterdir() if ".del-" not in p.name}
    loaded = Corpus.load(tmp_path / "c")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        loaded.save(tmp_path / "c")
    loaded.delete(["d40", "d5"])
    loaded.save(tmp_path / "c", overwrite=True)
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c").iterdir()}
    assert all(after[name] == t for name, t in before.items() if name != "manifest.json")
    assert {p.name for p in (tmp_path / "c").iterdir()} == listed(tmp_path / "c")  # the old tombstones removed
    live[[40, 5]] = False
    again = Corpus.load(tmp_path / "c")
    assert_oracle(again.search(queries, 50, progress=False, device="cpu"), oracle(queries, docs + more, live, 50), ids)
    loaded.save(tmp_path / "c", overwrite=True)  # nothing changed since: no write
    assert (tmp_path / "c" / "manifest.json").stat().st_mtime_ns == after["manifest.json"]

    # Another write since the load: saving back is refused, not merged or lost.
    first, second = Corpus.load(tmp_path / "c"), Corpus.load(tmp_path / "c")
    first.delete("d0")
    first.save(tmp_path / "c", overwrite=True)
    second.delete("d1")
    with pytest.raises(ValueError, match="changed on disk.*load it again"):
        second.save(tmp_path / "c", overwrite=True)
    # A corrupted or newer tombstone file is an error naming it.
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    name = manifest["segments"][0]["files"]["deleted"]["name"]
    data = bytearray((tmp_path / "c" / name).read_bytes())
    data[-1] ^= 1
    (tmp_path / "c" / name).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{name}.*corrupted"):
        Corpus.load(tmp_path / "c")
    manifest["tombstones"] = changes.TOMBSTONE_VERSION + 1
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="newer layout.*upgrade maxsim"):
        Corpus.load(tmp_path / "c", verify=False)


def test_corpora_saved_before_tombstones_still_load_and_change(tmp_path):
    docs, queries = int_docs(25), int_queries()
    ids = list(range(25))
    # The code path every corpus was written by before this change: format.write_corpus.
    corpus = Corpus.from_list(docs, ids=ids)
    array, lengths, stored_ids, _, _ = corpus._stored()
    corpus_format.write_corpus(tmp_path / "old", array, lengths, stored_ids, "float32")
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    assert "tombstones" not in manifest and manifest["version"] == 1
    old = Corpus.load(tmp_path / "old")
    assert old.num_deleted == 0
    want = oracle(queries, docs, np.ones(25, dtype=bool), 10)
    assert_oracle(old.search(queries, 10, progress=False, device="cpu"), want, ids)
    old.delete([2, 11])
    old.save(tmp_path / "old", overwrite=True)
    live = np.ones(25, dtype=bool)
    live[[2, 11]] = False
    assert_oracle(Corpus.load(tmp_path / "old").search(queries, 10, progress=False, device="cpu"),
                  oracle(queries, docs, live, 10), ids)
    Corpus.load(tmp_path / "old").compact(tmp_path / "old")
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    assert "tombstones" not in manifest and manifest["num_documents"] == 23  # as an old reader reads it
    assert len(corpus_format.open_corpus(tmp_path / "old")[1][0].ids) == 23


@pytest.mark.parametrize("encoding", [None, "bfloat16", "int8", "fp8"])
def test_compact_keeps_every_search_answer(tmp_path, encoding):
    parts = [int_docs(n, encoding) for n in (20, 15, 25)]
    queries = int_queries()
    ids = [f"d{j}" for j in range(60)]
    corpus = Corpus.from_list(parts[0], ids=ids[:20], encoding=encoding)
    corpus.save(tmp_path / "c")
    Corpus.from_list(parts[1], ids=ids[20:35], encoding=encoding).save(tmp_path / "c", append=True)
    Corpus.from_list(parts[2], ids=ids[35:], encoding=encoding).save(tmp_path / "c", append=True)
    corpus = Corpus.load(tmp_path / "c")
    third = json.loads((tmp_path / "c" / "manifest.json").read_text())["segments"][2]
    untouched = {f["name"] for f in third["files"].values()}
    corpus.delete([ids[j] for j in np.random.choice(20, size=6, replace=False)] + ids[20:35])  # segment 1: all of it
    live = corpus.live
    want = {k: searched(corpus, queries, k) for k in (5, 60)}
    in_memory = Corpus.load(tmp_path / "c")
    in_memory.delete([x for x, alive in zip(ids, live) if not alive])
    in_memory.compact()
    assert len(in_memory) == live.sum() == in_memory.num_live and len(in_memory.segments) == 2
    assert in_memory.ids == [x for x, alive in zip(ids, live) if alive]
    corpus.compact(tmp_path / "c")
    loaded = Corpus.load(tmp_path / "c")
    for k, answer in want.items():
        for c in (in_memory, corpus, loaded):
            assert same(searched(c, queries, k), answer)
    assert untouched <= {p.name for p in (tmp_path / "c").iterdir()}  # a segment without deletions is not rewritten
    assert {p.name for p in (tmp_path / "c").iterdir()} == listed(tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert "tombstones" not in manifest and all("deleted" not in s["files"] for s in manifest["segments"])
    # Everything deleted, then compacted: an empty corpus of the same d and encoding.
    loaded.delete(loaded.ids)
    loaded.compact(tmp_path / "c")
    empty = Corpus.load(tmp_path / "c")
    assert len(empty) == 0 and empty.encoding == corpus.encoding and empty.dim == D
    assert searched(empty, queries, 3)[0].shape == (len(queries), 0)


def test_leftovers_warn_once_and_cleanup_removes_them(tmp_path):
    docs = int_docs(10)
    Corpus.from_list(docs).save(tmp_path / "c")
    # What a killed save leaves: a temporary segment file, a renamed but uncommitted one, a temporary manifest.
    (tmp_path / "c" / "seg-00001-0badf00d.emb.npy.tmp").write_bytes(b"\x93NUMPY" + bytes(100))
    (tmp_path / "c" / "seg-00001-0badf00d.len.npy").write_bytes(bytes(28))
    (tmp_path / "c" / "manifest.json.tmp").write_text("{")
    with pytest.warns(changes.CorpusLeftoversWarning) as caught:
        corpus = Corpus.load(tmp_path / "c")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "\n" not in message and "3 file(s), 135 bytes" in message and "Corpus.cleanup(" in message
    assert len(corpus) == 10  # never read
    removed = Corpus.cleanup(tmp_path / "c")
    assert sorted(removed) == ["manifest.json.tmp", "seg-00001-0badf00d.emb.npy.tmp", "seg-00001-0badf00d.len.npy"]
    assert {p.name for p in (tmp_path / "c").iterdir()} == listed(tmp_path / "c")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Corpus.load(tmp_path / "c")


# ---------------------------------------------------------------------------------------------
# writers killed at every step


def _kill_at(n: int) -> None:
    """In the child: SIGKILL just before the n-th file rename or removal (0 = the first)."""
    count = {"n": 0}

    def hooked(real):
        def call(*args, **kwargs):
            if count["n"] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            count["n"] += 1
            return real(*args, **kwargs)
        return call

    os.replace = hooked(os.replace)
    os.unlink = hooked(os.unlink)


def _in_child(operation, directory: Path, n: int) -> int:
    """Run ``operation(directory)`` in a forked process killed at step ``n`` -> its exit status
    (0: it finished before step n; -SIGKILL: killed)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
            _kill_at(n)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                operation(directory)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    for _ in range(60_000):  # a bound on a hung child (about a minute), not a timing
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the writer killed at step {n} hung")


def _state(folder: Path, queries):
    """The corpus a folder holds, as a search and its positions see it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", changes.CorpusLeftoversWarning)
        corpus = Corpus.load(folder)
    r = corpus.search(queries, 40, progress=False, device="cpu")
    return r.scores, r.ids, r.indices, len(corpus), corpus.num_deleted


def _same_state(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and torch.equal(a[2], b[2]) and a[3:] == b[3:]


def _scenario(name, tmp_path):
    """A corpus folder of three segments with tombstones, and a write to it -> (folder, write)."""
    encoding = "int8" if name == "overwrite" else None
    parts = [int_docs(n, encoding) for n in (12, 10, 14)]
    ids = [f"d{j}" for j in range(36)]
    base = tmp_path / "base"
    Corpus.from_list(parts[0], ids=ids[:12], encoding=encoding).save(base)
    Corpus.from_list(parts[1], ids=ids[12:22], encoding=encoding).save(base, append=True)
    Corpus.from_list(parts[2], ids=ids[22:], encoding=encoding).save(base, append=True)
    corpus = Corpus.load(base)
    corpus.delete(["d1", "d5"] + ids[12:20])
    corpus.save(base, overwrite=True)
    new_docs = int_docs(3, encoding)
    other = Corpus.from_list(int_docs(9, encoding), ids=[f"o{j}" for j in range(9)], encoding=encoding)
    other.delete(["o2", "o7"])

    def delete(directory):
        c = Corpus.load(directory)
        c.delete(["d2", "d13", "d30", "d31"])
        c.save(directory, overwrite=True)

    def compact(directory):
        Corpus.load(directory).compact(directory)

    def update(directory):
        c = Corpus.load(directory)
        c.delete(["d0", "d25", "d26"])
        c.append(new_docs, ids=["d0", "d25", "d26"])
        c.save(directory, overwrite=True)

    def append(directory):
        Corpus.from_list(new_docs, ids=["d1", "n1", "n2"]).save(directory, append=True)  # d1: deleted, back

    def overwrite(directory):
        other.save(directory, overwrite=True)

    return base, {"delete": delete, "compact": compact, "update": update, "append": append,
                  "overwrite": overwrite}[name]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked writer")
@pytest.mark.parametrize("name", ["delete", "compact", "update", "append", "overwrite"])
def test_a_writer_killed_at_any_step_leaves_the_corpus_before_or_after(tmp_path, name):
    base, write = _scenario(name, tmp_path)
    queries = int_queries(3)
    before = _state(base, queries)
    done = tmp_path / "done"
    shutil.copytree(base, done)
    write(done)
    after = _state(done, queries)
    assert not _same_state(before, after)  # the write changes what is checked here
    seen = []
    for n in range(200):
        folder = tmp_path / f"killed-{n}"
        shutil.copytree(base, folder)
        status = _in_child(write, folder, n)
        assert status in (0, -signal.SIGKILL)
        state = _state(folder, queries)
        assert _same_state(state, before) or _same_state(state, after), f"killed at step {n}: neither before nor after"
        seen.append("after" if _same_state(state, after) else "before")
        # Whatever was left, the next write recovers: the corpus after it, only listed files.
        if seen[-1] == "before":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", changes.CorpusLeftoversWarning)
                write(folder)
        Corpus.cleanup(folder)
        assert _same_state(_state(folder, queries), after)
        assert {p.name for p in folder.iterdir()} == listed(folder)
        shutil.rmtree(folder)
        if status == 0:
            break
    assert seen[0] == "before" and seen[-1] == "after" and status == 0 and len(seen) > 3


# ---------------------------------------------------------------------------------------------
# command line


def _main(argv):
    """``python -m maxsim <argv>`` through maxsim.cli.main."""
    import maxsim.cli

    return maxsim.cli.main(argv)


def test_cli_delete_and_compact(tmp_path, monkeypatch, capsys):
    docs, queries = int_docs(15), int_queries()
    ids = [f"d{j}" for j in range(15)]
    Corpus.from_list(docs, ids=ids).save(tmp_path / "c")
    (tmp_path / "gone.txt").write_text("d3\nd9\n")
    assert _main(["delete", str(tmp_path / "c"), "--ids", str(tmp_path / "gone.txt")]) == 0
    assert "2 of 2 ids deleted" in capsys.readouterr().err
    live = np.ones(15, dtype=bool)
    live[[3, 9]] = False
    want = oracle(queries, docs, live, 15)
    assert_oracle(Corpus.load(tmp_path / "c").search(queries, 15, progress=False, device="cpu"), want, ids)
    (tmp_path / "unknown.txt").write_text("d3\nnot-there\n")
    assert _main(["delete", str(tmp_path / "c"), "--ids", str(tmp_path / "unknown.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'not-there'" in err and "--missing ignore" in err and "missing='ignore'" not in err
    assert _main(["delete", str(tmp_path / "c"), "--ids", str(tmp_path / "unknown.txt"),
                               "--missing", "ignore", "--quiet"]) == 0
    assert _main(["compact", str(tmp_path / "c")]) == 0
    assert "dropped 2 deleted documents" in capsys.readouterr().err
    compacted = Corpus.load(tmp_path / "c")
    assert len(compacted) == 13 and compacted.num_deleted == 0
    result = compacted.search(queries, 15, progress=False, device="cpu")
    assert torch.equal(result.scores, want[0]) and result.ids == [[ids[j] for j in row] for row in want[1].tolist()]
    Corpus.from_list(int_docs(3)).save(tmp_path / "n")  # int ids: the file must hold ints
    (tmp_path / "words.txt").write_text("1\ntwo\n")
    assert _main(["delete", str(tmp_path / "n"), "--ids", str(tmp_path / "words.txt")]) == 2
    assert "'two'" in capsys.readouterr().err


def test_append_checks_ids_at_the_boundary_of_the_ranges():
    """Ids that follow on are checked without a sort; the boundary cases still clash or pass exactly."""
    docs = int_docs(6)
    corpus = Corpus.from_list(docs[:3], ids=[10, 11, 12])
    corpus.append(docs[3:4], ids=[13])  # the next id: no clash
    with pytest.raises(ValueError, match=r"document id 13 is already in"):
        corpus.append(docs[4:5], ids=[13])  # the largest id again
    with pytest.raises(ValueError, match=r"document id 11 is already in"):
        corpus.append(docs[4:6], ids=[20, 11])  # a clash below a new largest id
    corpus.delete([13])
    corpus.append(docs[4:5], ids=[13])  # the largest id, deleted, comes back
    corpus.append(docs[5:6], ids=[5])  # below every id, no clash
    assert list(corpus.ids) == [10, 11, 12, 13, 13, 5] and corpus.num_live == 5
