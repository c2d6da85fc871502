"""The special token ids of tfformer's tokenizers, defined once for every package; this module imports nothing from
tfformer.

`SubwordTokenizer` reserves them (`tfformer.data`), the decode loops start, pad and stop with them
(`tfformer.generation`, the SavedModel's signatures, `tfformer.edge`).
"""

PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3


def cut_at_end(ids, end_id, keep_end=False):
    """The list `ids` up to its first `end_id` (included with `keep_end`), or all of it if there is none."""
    return ids[: ids.index(end_id) + int(keep_end)] if end_id in ids else ids
