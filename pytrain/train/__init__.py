"""The training run and its parts (``run``: the phases of ``pytrain train``; ``trainer``: one
optimizer step; ``evaluate``: validation metrics; ...).

The root package makes this package callable: ``pytrain.train(config, overrides=...)`` is
``pytrain.api.train``, and ``pytrain.train.run`` is still the module (see pytrain/__init__.py).
"""
