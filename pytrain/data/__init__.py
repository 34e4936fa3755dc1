"""Datasets (JSONL, Parquet, datasets folders: ``sources``) to token examples with a per-token
target mask, and examples to batches.

The loss (``pytrain.step.loss.shift_targets``) shifts targets itself, so this module only says, per
token, "this token is a target" (``train_mask``) and, per batch position, which sample it
belongs to (``seg``, -1 for padding).  Everything that decides what is trained happens here or
in ``chat_template``: assistant turns only for chats, the completion (+ EOS) for
prompt/completion records, everything for plain text.  The first token of a sample is never a
target (nothing precedes it), so an example counts as trainable only if its mask selects a
token after the first.

Nothing is dropped silently: every record that does not become an example is either an error
naming ``file:line`` (``on_error="stop"``) or counted by reason in :class:`DataStats`.
Reasons: ``malformed_json``, ``not_an_object``, ``unrecognised_record``, ``other_format``
(a record of another format than the file's: one file holds one format), ``bad_field``,
``unknown_role``, ``template_error`` (errors, subject to ``on_error``) and
``no_assistant_turn``, ``too_long`` (truncation "drop"), ``no_targets`` and, for preference
pairs, ``equal_after_truncation`` (always skipped and counted: they are valid records with
nothing to train).
"""

from pytrain.data.batches import make_batches, pad_token_id
from pytrain.data.examples import (ERROR_REASONS, ROLES, SKIP_REASONS, Batch, DataError,
                                   DataStats, Example)
from pytrain.data.records import (DataSplits, encode_record, load_data, load_examples,
                                  split_examples)

__all__ = ["Batch", "DataError", "DataSplits", "DataStats", "ERROR_REASONS", "Example", "ROLES",
           "SKIP_REASONS", "encode_record", "load_data", "load_examples", "make_batches",
           "pad_token_id", "split_examples"]
