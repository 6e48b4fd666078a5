"""Drop-in MaxSim for the libraries users score with.

Each submodule mirrors one library's scoring entry points with that library's signatures, shapes,
mask rule and output dtype, and has ``patch()`` / ``unpatch()`` to make the library's own code run
maxsim:

- ``maxsim.integrations.pylate``: PyLate (``pylate.scores``, ranking, losses);
- ``maxsim.integrations.sentence_transformers``: Sentence Transformers 6 (``util.maxsim``,
  ``MultiVectorEncoder``, the multi-vector losses);
- ``maxsim.integrations.colpali``: colpali-engine (``score_multi_vector``, the late-interaction losses).

This package imports nothing optional: a submodule imports its library only when a function that
needs it runs (``patch()`` above all). Importing a submodule patches nothing.
"""
