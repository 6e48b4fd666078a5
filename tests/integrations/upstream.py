"""A pytest plugin that runs a library's own test files with maxsim's drop-in patched in.

    python -m pytest -p upstream --maxsim-patch pylate  path/to/pylate/tests/test_colbert_scores.py
    python -m pytest -p upstream --maxsim-patch colpali path/to/colpali/tests/utils/test_maxsim.py

(``tests/integrations`` on PYTHONPATH; .ci/run fetches the test files from the libraries' source
distributions.) ``patch()`` runs before the test modules are imported, so every scoring function
they import is maxsim's. The session fails when maxsim's kernels served no call: a test file that
passes without reaching maxsim proves nothing.
"""

from __future__ import annotations

import importlib

import maxsim

_ENTRY_POINTS = ("maxsim", "maxsim_varlen", "score_pairs_packed")
_calls = {"count": 0}


def pytest_addoption(parser):
    parser.addoption("--maxsim-patch", required=True, choices=("pylate", "colpali", "sentence_transformers"),
                     help="the maxsim.integrations module whose patch() the run applies")


def pytest_configure(config):
    for name in _ENTRY_POINTS:  # count what reaches maxsim (the drop-ins call these by attribute)
        real = getattr(maxsim, name)

        def counted(*args, _real=real, **kwargs):
            _calls["count"] += 1
            return _real(*args, **kwargs)

        setattr(maxsim, name, counted)
    integration = importlib.import_module(f"maxsim.integrations.{config.getoption('--maxsim-patch')}")
    integration.patch()
    config._maxsim_integration = integration


def pytest_sessionfinish(session, exitstatus):
    count = _calls["count"]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"maxsim served {count} scoring calls of these tests "
                            f"({session.config.getoption('--maxsim-patch')} patched)")
    if count == 0 and exitstatus == 0:
        session.exitstatus = 1
