"""One worker of a two-worker MultiWorkerMirroredStrategy run (TF_CONFIG set by the test): trains one epoch with
dropout, then calls a Dropout layer once; saves the weights, that layer's mask and the seed pair it drew."""

import sys

import numpy as np

out_path = sys.argv[1]

from tfformer.training import get_strategy  # noqa: E402

strategy = get_strategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfformer import layers, models, training  # noqa: E402

assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), type(strategy)
keras.utils.set_random_seed(0)  # identical initial weights on both workers
config = models.TransformerConfig(vocabulary_size=30, hidden_dim=16, num_heads=2, intermediate_dim=32,
                                  num_encoder_layers=1, num_decoder_layers=1, dropout=0.1)
rng = np.random.default_rng(0)
src = rng.integers(1, 30, size=(32, 7)).astype("int32")
tgt = rng.integers(1, 30, size=(32, 6)).astype("int32")
src[::3, 5:] = 0
dec_in = np.concatenate([np.full((32, 1), 2, "int32"), tgt[:, :-1]], axis=1)
dataset = tf.data.Dataset.from_tensor_slices(({"encoder_token_ids": src, "decoder_token_ids": dec_in}, tgt)).batch(8)

with strategy.scope():
    model = models.build_seq2seq(config)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=training.MaskedSparseCrossEntropy(0.1))
initial = [w.copy() for w in model.get_weights()]
history = training.fit(model, dataset, validation_data=dataset, epochs=1, strategy=strategy, verbose=0)
assert np.isfinite(history["loss"][-1]) and "val_loss" in history, history
assert any(not np.allclose(a, b) for a, b in zip(initial, model.get_weights())), "no update"

with strategy.scope():
    probe, twin = layers.Dropout(0.5, seed=3), layers.Dropout(0.5, seed=3)
seed = twin.seed_generator.next().numpy()  # the pair `probe` draws on its first call, on every worker
mask = strategy.run(tf.function(lambda: probe(tf.ones((6, 40)), training=True)))
mask = strategy.experimental_local_results(mask)[0].numpy() != 0  # this worker's one replica
np.savez(out_path, *model.get_weights(), seed=seed, mask=mask)
