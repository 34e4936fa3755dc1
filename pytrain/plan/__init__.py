"""Before a run: the memory a config's run will need and whether it fits (``run_memory``:
``pytrain plan``), and a step timed node by node (``profile``: ``pytrain profile``).
"""
