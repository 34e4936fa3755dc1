"""One optimizer step: the masked loss (``loss``), the step and evaluation graphs
(``graphs``, ``recompute``), AdamW (``optimizer``), a step over micro-batches (``trainer``),
the preference loss, evaluation, and the step's all-reduce across MPI ranks (``distributed``).
"""
