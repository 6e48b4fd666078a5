"""Progress bars: tqdm where it is installed and wanted; without it, one hint naming the install."""

import builtins

import maxsim._progress as progress


def test_a_wanted_bar_without_tqdm_hints_once(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    monkeypatch.setattr(progress, "_HINTED", [])
    assert progress.progress_bar(True, 10, "work", "doc") is None
    assert progress.progress_bar(True, 10, "work", "doc") is None
    err = capsys.readouterr().err
    assert err.count("pip install tqdm") == 1
    assert progress.progress_bar(False, 10, "work", "doc") is None  # not wanted: no hint either
    assert capsys.readouterr().err == ""
