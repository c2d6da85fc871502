import pytest

from tests.harness import spread  # re-exported for the export tests
from tfformer import data, models

PAIRS = [("open the file", "Datei öffnen"), ("close the file", "Datei schließen"),
         ("save the folder", "Ordner speichern"), ("delete a file", "eine Datei löschen"),
         ("Error: %s\n", "Fehler: %s\n")]
CFG = dict(hidden_dim=16, num_heads=2, intermediate_dim=32, num_encoder_layers=1, num_decoder_layers=2, dropout=0.0,
           max_sequence_length=32, norm_first=True, tie_embeddings=False)


@pytest.fixture(scope="session")
def tokenizer():
    return data.SubwordTokenizer.train([s for pair in PAIRS for s in pair] * 20, vocabulary_size=60)


@pytest.fixture(scope="session")
def seq2seq(tokenizer):
    return spread(models.build_seq2seq(models.TransformerConfig(vocabulary_size=tokenizer.vocabulary_size, **CFG)))


@pytest.fixture(scope="session")
def causal_lm(tokenizer):
    config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=tokenizer.vocabulary_size, **CFG)
    return spread(models.build_causal_lm(config), seed=1)
