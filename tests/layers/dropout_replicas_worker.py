"""Run in a subprocess: one Dropout call on each of 2 replicas; saves each replica's mask and the seed pair drawn.

    dropout_replicas_worker.py OUT.npz
"""

import sys

from tfformer.training import get_strategy

strategy = get_strategy(replicas=2)  # before any tensor exists

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfformer.layers import Dropout  # noqa: E402

with strategy.scope():
    layer, twin = Dropout(0.5, seed=3), Dropout(0.5, seed=3)
seed = twin.seed_generator.next().numpy()  # the pair `layer` draws on its first call, on every replica
outputs = strategy.run(tf.function(lambda: layer(tf.ones((6, 40)), training=True)))
masks = [t.numpy() != 0 for t in strategy.experimental_local_results(outputs)]
np.savez(sys.argv[1], seed=seed, masks=np.stack(masks))
