"""A training run around the steps: its phases and step loop (``loop``: ``pytrain train``), its
folder, checkpoints, ``--resume``, what it records, and how it stops.
"""
