"""The index and search commands, through parsers built here (the lead wires them into maxsim.cli)."""

import json

import numpy as np
import pytest
import torch

import maxsim
from commands import parse, run


def sorted_topk(full, k):
    values, order = torch.sort(full, stable=True, dim=-1, descending=True)
    return values[..., :k], order[..., :k]


def test_index_then_search_trec_and_jsonl(tmp_path, capsys):
    docs = [torch.randint(-3, 4, (int(n), 8)).float() for n in torch.randint(1, 6, (40,))]
    more = [torch.randint(-3, 4, (int(n), 8)).float() for n in torch.randint(1, 6, (10,))]
    queries = [torch.randint(-3, 4, (int(n), 8)).float() for n in (2, 4, 3)]
    packed = torch.cat(docs).numpy()
    np.save(tmp_path / "docs.npy", packed)
    np.save(tmp_path / "lengths.npy", np.array([x.shape[0] for x in docs]))
    (tmp_path / "ids.txt").write_text("".join(f"doc{j}\n" for j in range(40)))
    torch.save({"embeddings": more, "ids": [f"doc{j}" for j in range(40, 50)]}, tmp_path / "more.pt")
    torch.save({"embeddings": queries, "ids": ["q1", "q2", "q3"]}, tmp_path / "queries.pt")

    assert run(["index", "--out", str(tmp_path / "c"), str(tmp_path / "docs.npy"),
                "--lengths", str(tmp_path / "lengths.npy"), "--ids", str(tmp_path / "ids.txt")]) == 0
    assert run(["index", "--out", str(tmp_path / "c"), "--append", str(tmp_path / "more.pt")]) == 0
    assert "50" not in capsys.readouterr().out  # summaries go to stderr

    assert run(["search", "--corpus", str(tmp_path / "c"), "--queries", str(tmp_path / "queries.pt"),
                "-k", "7", "--out", str(tmp_path / "run.trec"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "3 queries x 50 documents" in err
    values, order = sorted_topk(maxsim.maxsim_varlen(queries, docs + more), 7)
    lines = (tmp_path / "run.trec").read_text().splitlines()
    assert len(lines) == 21
    expect = [f"{q} Q0 doc{order[i, r].item()} {r + 1} {values[i, r].item():.6f} maxsim"
              for i, q in enumerate(["q1", "q2", "q3"]) for r in range(7)]
    assert lines == expect

    assert run(["search", "--corpus", str(tmp_path / "c"), "--queries", str(tmp_path / "queries.pt"),
                "-k", "100", "--out", str(tmp_path / "run.jsonl"), "--quiet", "--load", "host"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["qid"] for r in rows] == ["q1", "q2", "q3"]
    assert rows[1]["docids"] == [f"doc{j}" for j in sorted_topk(maxsim.maxsim_varlen(queries, docs + more), 50)[1][1].tolist()]


def test_padded_npy_safetensors_and_errors(tmp_path):
    D = torch.randn(12, 5, 4)
    lengths = np.array([5, 1, 3, 0, 2, 5, 4, 4, 1, 2, 3, 5])
    np.save(tmp_path / "padded.npy", D.numpy())
    np.save(tmp_path / "len.npy", lengths)
    assert run(["index", "--out", str(tmp_path / "c"), str(tmp_path / "padded.npy"), "--lengths", str(tmp_path / "len.npy"),
                "--dtype", "float16", "--quiet"]) == 0
    from maxsim.search import Corpus

    corpus = Corpus.load(tmp_path / "c")
    assert corpus.dtype == torch.float16 and corpus.num_tokens == int(lengths.sum())
    assert torch.equal(corpus.document(2), D[2, :3].half())
    assert run(["index", "--out", str(tmp_path / "c"), str(tmp_path / "padded.npy"), "--quiet"]) == 2  # exists
    np.save(tmp_path / "packed.npy", np.zeros((7, 4), np.float32))
    with pytest.raises(ValueError, match="--lengths"):
        run(["index", "--out", str(tmp_path / "d"), str(tmp_path / "packed.npy")])
    with pytest.raises(ValueError, match="unknown embedding file type"):
        (tmp_path / "x.txt").write_text("1")
        run(["index", "--out", str(tmp_path / "d"), str(tmp_path / "x.txt")])
    with pytest.raises(SystemExit):
        parse(["search", "--corpus", "c", "--queries", "q", "--gpu-memory", "lots", "--out", "o"])


def test_safetensors_queries(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    docs = [torch.randint(-3, 4, (int(n), 4)).half() for n in torch.randint(0, 5, (20,))]
    safetensors.save_file({"embeddings": torch.cat(docs), "lengths": torch.tensor([x.shape[0] for x in docs])},
                          str(tmp_path / "d.safetensors"))
    queries = {"qa": torch.randint(-3, 4, (3, 4)).half(), "qb": torch.randint(-3, 4, (2, 4)).half()}
    safetensors.save_file(queries, str(tmp_path / "q.safetensors"))
    assert run(["index", "--out", str(tmp_path / "c"), str(tmp_path / "d.safetensors"), "--quiet"]) == 0
    assert run(["search", "--corpus", str(tmp_path / "c"), "--queries", str(tmp_path / "q.safetensors"),
                "-k", "3", "--out", str(tmp_path / "r.jsonl"), "--quiet"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    values, order = sorted_topk(maxsim.maxsim_varlen(list(queries.values()), docs), 3)
    assert [r["qid"] for r in rows] == ["qa", "qb"]
    assert [r["docids"] for r in rows] == order.tolist() and [r["scores"] for r in rows] == values.tolist()


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit):
        parse(["search", "--help"])
    assert "example:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parse(["index", "--help"])
    assert "python -m maxsim index" in capsys.readouterr().out


def test_a_users_mistakes_are_one_line_naming_the_fix(tmp_path, capsys, monkeypatch):
    """``python -m maxsim`` as a new user meets it: each mistake exits 2 with one line on stderr that
    names the problem (and the option that fixes it), no traceback; a NaN never becomes a ranking."""
    from maxsim.cli import main

    monkeypatch.delenv("MAXSIM_DEBUG", raising=False)
    docs = [torch.nn.functional.normalize(torch.randn(int(n), 8), dim=-1) for n in torch.randint(1, 6, (30,))]
    np.save(tmp_path / "docs.npy", torch.cat(docs).numpy())
    np.save(tmp_path / "lengths.npy", np.array([x.shape[0] for x in docs]))
    corpus = str(tmp_path / "c")
    assert main(["index", "--out", corpus, str(tmp_path / "docs.npy"), "--lengths", str(tmp_path / "lengths.npy"),
                 "--quiet"]) == 0
    capsys.readouterr()
    queries = [torch.nn.functional.normalize(torch.randn(3, 8), dim=-1) for _ in range(2)]
    torch.save(queries, tmp_path / "q.pt")
    np.save(tmp_path / "q2d.npy", torch.cat(queries).numpy())
    np.save(tmp_path / "q64.npy", torch.stack(queries).double().numpy())
    np.save(tmp_path / "bad_lengths.npy", np.array([5, -2]))
    torch.save({"vectors": queries}, tmp_path / "nokey.pt")
    nan_queries = [q.clone() for q in queries]
    nan_queries[1][2, 3] = float("nan")
    torch.save(nan_queries, tmp_path / "nan.pt")
    np.save(tmp_path / "docs64.npy", torch.cat(docs).double().numpy())
    search = ["search", "--corpus", corpus, "--out", str(tmp_path / "run.trec"), "--no-progress", "--quiet"]
    cases = [
        (["index", "--out", corpus, str(tmp_path / "docs.npy"), "--lengths", str(tmp_path / "lengths.npy")],
         "--overwrite"),
        (["index", "--out", str(tmp_path / "d"), str(tmp_path / "missing.npy")], "missing.npy"),
        (["index", "--out", str(tmp_path / "d"), str(tmp_path / "docs64.npy"), "--lengths",
          str(tmp_path / "lengths.npy")], "--dtype float32"),
        (["index", "--out", str(tmp_path / "d"), str(tmp_path / "docs.npy"), "--lengths",
          str(tmp_path / "bad_lengths.npy")], "entry 1 is -2"),
        (search + ["--queries", str(tmp_path / "q2d.npy")], "--query-lengths"),
        (search + ["--queries", str(tmp_path / "q64.npy")], "float64 queries"),
        (search + ["--queries", str(tmp_path / "nokey.pt")], "without 'embeddings'"),
        (search + ["--queries", str(tmp_path / "nan.pt")], "query 1 of"),
        (search + ["--queries", str(tmp_path / "q.pt"), "--out", str(tmp_path / "no" / "such" / "run.trec")],
         "No such file or directory"),
        (["search", "--corpus", str(tmp_path / "nothing"), "--queries", str(tmp_path / "q.pt"), "--out", "-"],
         "nothing"),
    ]
    if not torch.cuda.is_available():
        cases.append((search + ["--queries", str(tmp_path / "q.pt"), "--device", "cuda"], "--device cpu"))
    for argv, fix in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err and fix in lines[0], (argv, err)
        assert lines[0].startswith(f"maxsim {argv[0]}: ")
    assert not (tmp_path / "run.trec").exists()

    # a NaN token in the corpus: its document would score NaN and rank first; the search refuses
    docs[4] = docs[4].clone()
    docs[4][0, 0] = float("nan")
    maxsim.Corpus.from_list(docs).save(tmp_path / "nan_corpus")
    assert main(["search", "--corpus", str(tmp_path / "nan_corpus"), "--queries", str(tmp_path / "q.pt"),
                 "--out", str(tmp_path / "run.trec"), "--quiet", "--no-progress"]) == 2
    assert "document 4 of the corpus scores NaN" in capsys.readouterr().err
    assert not (tmp_path / "run.trec").exists()
    monkeypatch.setenv("MAXSIM_DEBUG", "1")  # the traceback, for a bug report
    with pytest.raises(ValueError):
        main(search + ["--queries", str(tmp_path / "q64.npy").replace("q64", "nokey").replace(".npy", ".pt")])


def test_index_progress_counts_every_input_and_closes(tmp_path, monkeypatch):
    """The index bar: one step of an input file's bytes, each input named while it is worked on."""
    import maxsim.search.cli as search_cli
    from maxsim.cli import main

    class Recorder:
        def __init__(self, progress, total, description, unit):
            self.total, self.done, self.postfixes, self.closed = total, 0, [], False
            self.desc, self.descriptions, self.messages = description, [], []
            bars.append(self)

        def update(self, n):
            self.done += n

        def set_postfix_str(self, text, refresh=True):
            self.postfixes.append(text)

        def set_description_str(self, text, refresh=True):
            self.desc = text
            self.descriptions.append(text)

        def write(self, text, file=None):  # tqdm.write: a message above the bar, never over it
            self.messages.append(text)

        def close(self):
            self.closed = True

    bars = []
    monkeypatch.setattr(search_cli, "progress_bar", Recorder)
    rng = np.random.default_rng()
    inputs = []
    for n, count in enumerate((3, 5)):
        lengths = rng.integers(1, 9, size=count)
        np.save(tmp_path / f"d{n}.npy", rng.standard_normal((int(lengths.sum()), 8)).astype(np.float32))
        np.save(tmp_path / f"l{n}.npy", lengths)
        inputs.append(n)
    argv = ["index", "--out", str(tmp_path / "c"), str(tmp_path / "d0.npy"), str(tmp_path / "d1.npy"),
            "--lengths", str(tmp_path / "l0.npy"), "--lengths", str(tmp_path / "l1.npy")]
    assert main(argv) == 0
    (bar,) = bars
    sizes = [(tmp_path / f"d{n}.npy").stat().st_size for n in inputs]
    assert bar.total == bar.done == sum(sizes) and bar.closed
    assert any("d0.npy" in text for text in bar.postfixes) and any("d1.npy" in text for text in bar.postfixes)
    assert len(maxsim.Corpus.load(tmp_path / "c")) == 8
    assert len(bar.messages) == 1 and "8 documents" in bar.messages[0]  # the summary, through the bar
    # a residual codec's training: said through the bar, and named on it while it runs
    bars.clear()
    assert main(argv[:2] + [str(tmp_path / "r")] + argv[3:] + ["--encoding", "residual2", "--num-centroids", "4"]) == 0
    (bar,) = bars
    assert any("training a residual2 codec" in m for m in bar.messages)
    assert bar.descriptions[0] == "maxsim index: training the residual2 codec" and bar.desc == "maxsim index"


def _small_corpus(tmp_path, dtype=torch.float32, n=20):
    docs = [torch.randint(-3, 4, (int(L), 8)).to(dtype) for L in torch.randint(1, 6, (n,))]
    maxsim.Corpus.from_list(docs, ids=[f"d{j}" for j in range(n)]).save(tmp_path / "c")
    queries = [torch.randint(-3, 4, (3, 8)).float() for _ in range(4)]
    torch.save({"embeddings": queries}, tmp_path / "q.pt")
    return docs, queries


def test_out_writes_through_links_fifos_and_devices(tmp_path):
    import os
    import threading

    from maxsim.cli import main

    _small_corpus(tmp_path)
    search = ["search", "--corpus", str(tmp_path / "c"), "--queries", str(tmp_path / "q.pt"), "-k", "3",
              "--quiet", "--no-progress", "--out"]
    assert main(search + [str(tmp_path / "run.trec")]) == 0  # a new regular file
    lines = (tmp_path / "run.trec").read_text().splitlines()
    assert len(lines) == 12 and not list(tmp_path.glob("*.tmp"))
    (tmp_path / "target.trec").write_text("old\n")
    os.symlink(tmp_path / "target.trec", tmp_path / "link.trec")
    assert main(search + [str(tmp_path / "link.trec")]) == 0
    assert (tmp_path / "link.trec").is_symlink()  # the link stays, its target holds the run
    assert (tmp_path / "target.trec").read_text().splitlines() == lines
    os.mkfifo(tmp_path / "fifo")
    got = []
    reader = threading.Thread(target=lambda: got.append((tmp_path / "fifo").read_text()))
    reader.start()
    assert main(search + [str(tmp_path / "fifo")]) == 0
    reader.join(30)
    assert got and got[0].splitlines() == lines and not (tmp_path / "fifo.tmp").exists()
    if os.access("/dev/null", os.W_OK):
        assert main(search + ["/dev/null"]) == 0
        assert not os.path.isfile("/dev/null")  # still the device, not a file renamed over it


def test_empty_and_unreadable_inputs_are_one_line(tmp_path, capsys):
    from maxsim.cli import main

    _small_corpus(tmp_path)
    for name in ("empty.npy", "empty.pt"):
        (tmp_path / name).write_bytes(b"")
        for argv in (["index", "--out", str(tmp_path / "new"), str(tmp_path / name), "--lengths",
                      str(tmp_path / "empty.npy")],
                     ["search", "--corpus", str(tmp_path / "c"), "--queries", str(tmp_path / name), "--out", "-"]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and "is empty (0 bytes)" in err, err
    (tmp_path / "text.pt").write_text("not a tensor file")
    assert main(["search", "--corpus", str(tmp_path / "c"), "--queries", str(tmp_path / "text.pt"), "--out", "-"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "could not be read as a .pt file" in err
    np.save(tmp_path / "none.npy", np.zeros((0, 32, 8), dtype=np.float32))
    assert main(["search", "--corpus", str(tmp_path / "c"), "--queries", str(tmp_path / "none.npy"), "--out", "-"]) == 2
    assert "holds no queries (shape [0, 8])" in capsys.readouterr().err


def test_a_float_corpus_takes_queries_of_any_float_dtype(tmp_path, capsys):
    from maxsim.cli import main

    docs, queries = _small_corpus(tmp_path, dtype=torch.float16)
    assert main(["search", "--corpus", str(tmp_path / "c"), "--queries", str(tmp_path / "q.pt"), "-k", "5",
                 "--out", str(tmp_path / "run.jsonl"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count("float32 queries scored as the corpus's float16") == 1
    rows = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    values, order = sorted_topk(maxsim.maxsim_varlen([q.half() for q in queries], docs), 5)
    assert [r["docids"] for r in rows] == [[f"d{j}" for j in row] for row in order.tolist()]


def test_search_summary_counts_the_live_documents(tmp_path, capsys):
    from maxsim.cli import main

    _small_corpus(tmp_path, n=20)
    (tmp_path / "gone.txt").write_text("d1\nd2\nd3\n")
    assert main(["delete", str(tmp_path / "c"), "--ids", str(tmp_path / "gone.txt"), "--quiet"]) == 0
    assert main(["search", "--corpus", str(tmp_path / "c"), "--queries", str(tmp_path / "q.pt"), "-k", "3",
                 "--out", str(tmp_path / "run.trec"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "4 queries x 17 documents" in err and "3 deleted ones left out" in err, err


def test_broken_pipe_and_info_under_any_backend(tmp_path):
    import os
    import subprocess
    import sys

    _small_corpus(tmp_path, n=30)
    many = [torch.randint(-3, 4, (3, 8)).float() for _ in range(400)]
    torch.save({"embeddings": many}, tmp_path / "many.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "maxsim", "search", "--corpus", str(tmp_path / "c"), "--queries",
                             str(tmp_path / "many.pt"), "-k", "30", "--out", "-", "--no-progress", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline()  # `| head -1`: the reader leaves after one line
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 0, err
    assert first.startswith(b"0 Q0 d") and "Broken pipe" not in err and "Traceback" not in err
    env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    env["MAXSIM_BACKEND"] = "triton"  # a backend this CPU cannot run without the interpreter
    out = subprocess.run([sys.executable, "-m", "maxsim", "info"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "backend for CPU tensors: none (MAXSIM_BACKEND=triton with tensors on cpu needs TRITON_INTERPRET=1" in out.stdout


def test_help_lists_every_encoding():
    import argparse

    from maxsim.search.cli import add_index_parser

    parser = argparse.ArgumentParser(prog="maxsim")
    add_index_parser(parser.add_subparsers())
    text = parser._subparsers._group_actions[0].choices["index"].format_help()
    for name in ("float16", "bfloat16", "float32", "int8", "fp8", "residual2", "residual4", "pq<m>"):
        assert name in text, name
