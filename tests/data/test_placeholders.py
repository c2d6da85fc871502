import collections

import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfformer.data import placeholders as ph

# Placeholders as GNU gettext's c-format, python-format and python-brace-format read them, tags and entities.
# The lone `%`, `{`, `}`, `<`, `>` are protected too, but left out here: a model's word right after a restored
# lone `%` can make a new conversion, which is why a model's own lone ones are removed.
PLACEHOLDERS = ["%s", "%d", "%.2f", "%1$s", "%2$d", "%%", "%lu", "%'d", "%-10s", "%*d", "%.*s", "%5.1f%%", "%zu",
                "%<PRIu64>", "%(name)s", "%(count)d", "{name}", "{0:>3}", "{}", "{{", "}}", "<b>", "</b>",
                "<a href=\"x\">", "&amp;", "&#169;", "\ue003"]
WORDS = ["file", "Open", "cannot", "read", "the", "über", "Größe", "x", "a_b", "R&D", "100", "(", ")", ":", ",", "."]
EDGES = ["", "\n", "\n\n", " ", "\t", "  \n", "\r\n"]


@st.composite
def messages(draw):
    parts = draw(st.lists(st.sampled_from(PLACEHOLDERS + WORDS + WORDS), min_size=1, max_size=12))
    body = " ".join(parts)
    if draw(st.booleans()):
        body = draw(st.sampled_from(["_", "&"])) + body if body[0].isalpha() else body
    return draw(st.sampled_from(EDGES)) + body + draw(st.sampled_from(EDGES))


def model_outputs():
    # What any model could emit: words, whitespace, reserved characters (known, unknown, repeated) and
    # placeholders written out as text.
    pieces = st.sampled_from(WORDS + PLACEHOLDERS + [" ", "\n", "\t", "", "%", "{", "<", ">", "_Datei", "&Datei"]
                             + [chr(ph.BASE + i) for i in range(12)])
    return st.lists(pieces, max_size=15).map("".join)


def _ordered(text):
    return [p for p in ph.find_placeholders(text) if ph.is_ordered(p)]


def test_finds_gettext_placeholders():
    assert ph.find_placeholders("%u cached (%.2f%%)\n") == ["%u", "%.2f", "%%"]
    assert ph.find_placeholders("%1$s of %2$'d: %-10lu %hhd %<PRIu64> %m") == [
        "%1$s", "%2$'d", "%-10lu", "%hhd", "%<PRIu64>", "%m"]
    assert ph.find_placeholders("%(name)s has {count:>3} <b>new</b> &amp; {{x}}") == [
        "%(name)s", "{count:>3}", "<b>", "</b>", "&amp;", "{{", "}}"]
    assert ph.find_placeholders("100% sure") == ["% s"]  # a space flag: gettext reads a conversion here too
    assert ph.find_placeholders("50%.") == ["%"]
    assert [ph.is_ordered(p) for p in ["%s", "%.2f", "%%", "%1$s", "%(n)s", "{0}", "%*d"]] == [
        True, True, False, False, False, False, True]


def test_mask_and_restore_examples():
    masked = ph.mask("\n  _Open %s file (%.2f%%)\t")
    assert (masked.prefix, masked.suffix, masked.accelerator) == ("\n  ", "\t", "_")
    assert masked.text == "Open \ue000 file (\ue001\ue002)"
    assert masked.placeholders == ("%s", "%.2f", "%%")
    # Repeats and unknown reserved characters dropped, a missing one appended, invented text placeholders removed.
    out = ph.restore(masked, "\n\ue001 Datei \ue000 öffnen \ue000 \ue007 %d\n")
    assert out == "\n  %s _Datei %.2f öffnen   %%\t"  # unnumbered conversions in source order
    # Numbered and named placeholders may move.
    masked = ph.mask("%1$s of %2$s")
    assert ph.restore(masked, "\ue001 von \ue000") == "%2$s von %1$s"
    # Nothing to translate: copied as it is.
    assert not ph.mask("%s: %s\n").translatable
    assert ph.restore(ph.mask("%s: %s\n"), "Unsinn") == "%s: %s\n"
    assert ph.restore(ph.mask("&Save"), "Speichern") == "&Speichern"
    assert ph.restore(ph.mask("_Save"), "\ue000 ... ") == "_..."  # no letter: the mark at the start


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages(), model_outputs())
def test_restore_keeps_every_placeholder_exactly_once(source, output):
    masked = ph.mask(source)
    restored = ph.restore(masked, output)
    assert collections.Counter(ph.find_placeholders(restored)) == collections.Counter(ph.find_placeholders(source))
    assert _ordered(restored) == _ordered(source)  # C conversions without numbers keep their order
    assert restored.startswith(masked.prefix) and restored.endswith(masked.suffix)
    core = restored[len(masked.prefix): len(restored) - len(masked.suffix)]
    assert core == core.strip(" \t\n\r\f\v")  # exactly the source's leading/trailing whitespace
    if masked.accelerator:
        assert masked.accelerator in core


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(messages(), model_outputs()), min_size=1, max_size=8))
def test_tf_ops_equal_python(batch):
    sources, outputs = [s for s, _ in batch], [o for _, o in batch]
    masked = ph.mask_tf(tf.constant(sources))
    expected = [ph.mask(s) for s in sources]
    assert [t.decode() for t in masked["text"].numpy()] == [m.text for m in expected]
    assert [list(p) for p in masked["placeholders"].to_list()] == [[x.encode() for x in m.placeholders]
                                                                    for m in expected]
    assert [a.decode() for a in masked["accelerator"].numpy()] == [m.accelerator for m in expected]
    assert masked["translatable"].numpy().tolist() == [m.translatable for m in expected]
    restored = [t.decode() for t in ph.restore_tf(masked, tf.constant(outputs)).numpy()]
    assert restored == [ph.restore(m, o) for m, o in zip(expected, outputs)]


def test_tf_ops_in_a_graph_with_empty_and_placeholder_free_rows():
    fn = tf.function(lambda texts, outputs: ph.restore_tf(ph.mask_tf(texts), outputs),
                     input_signature=[tf.TensorSpec([None], tf.string)] * 2)
    sources = ["", "Open file", "\n", "%s of %d\n"]
    outputs = ["", "Datei öffnen\n", "x", "\ue001 von \ue000"]
    assert [t.decode() for t in fn(tf.constant(sources), tf.constant(outputs)).numpy()] == [
        "", "Datei öffnen", "\n", "%s von %d\n"]
    assert fn(tf.constant([], tf.string), tf.constant([], tf.string)).shape == (0,)


def test_mask_rejects_non_strings():
    with pytest.raises(ValueError, match="`text` must be a str"):
        ph.mask(b"bytes")


def test_mask_pair_numbers_the_target_like_the_source():
    source, target = ph.mask_pair("\n_Open %s of %d (%s)\n", "\n%s von %d _öffnen %x (%s)\n")
    assert source == "Open \ue000 of \ue001 (\ue002)"
    assert target == "\ue000 von \ue001 öffnen  (\ue002)"  # %x is not in the source: dropped


def test_empty_model_output_gives_the_source_text_not_bare_edges():
    assert ph.restore(ph.mask("...Time is up!\n"), " \n") == "...Time is up!\n"
    assert ph.restore(ph.mask("_Quit\n"), "") == "_Quit\n"


def test_reserved_symbols_are_single_pieces_of_a_new_tokenizer():
    from tfformer.data import SubwordTokenizer

    texts = ["open the file \ue000", "Datei \ue000 öffnen", "close \ue001 of \ue000", "schließen"] * 20
    tokenizer = SubwordTokenizer.train(texts, vocabulary_size=128)
    ids = tokenizer.tokenize(["\ue000\ue001\ue007"]).to_list()[0]
    assert len(ids) == 3 and 1 not in ids  # one known piece each, also for one never seen in training
    assert tokenizer.detokenize([ids]).numpy()[0].decode() == "\ue000\ue001\ue007"
