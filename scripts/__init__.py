"""pytrain's developer scripts: benchmarks, reference fixtures, reports and build helpers.

Run them from the repository root as modules, ``python -m scripts.bench_train --help``, so
that ``pytrain`` (the checkout or the installed package) and the shared modules here
(``scripts.bench_common``, ``scripts.gguf_models``) import without path edits.
"""
