"""Run in a subprocess: jobs of 3 steps of a tiny seq2seq each, one after another, under get_strategy(replicas=N);
each saves its final weights and the `evaluate` results on one batch after them (WEIGHTS_OUT.evaluate.json).
One process per replica count: TensorFlow's start costs more than a job.

    replica_worker.py REPLICAS JOB [JOB...]
    JOB: a JSON list [WEIGHTS_IN or "-", WEIGHTS_OUT(, "sgd"|"adam"|"fused_adam"(, "fused"|"unfused"(,
    MICRO_BATCHES)))] (WEIGHTS_IN "-": only save a new model's initial weights, from seed 1; SGD by default; the loss's
    `fuse_projection` on by default; compile's `micro_batches` 1 by default). JSON, so a path may hold any character.
"""

import json
import sys

import numpy as np

replicas, jobs = int(sys.argv[1]), [[str(part) for part in json.loads(job)] for job in sys.argv[2:]]

from tfformer.training import get_strategy  # noqa: E402

strategy = get_strategy(replicas=replicas)  # before any tensor exists

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfformer import models  # noqa: E402
from tfformer.training import FusedAdam, MaskedAccuracy, MaskedSparseCrossEntropy, Perplexity  # noqa: E402

assert strategy.num_replicas_in_sync == replicas, strategy.num_replicas_in_sync
config = models.TransformerConfig(vocabulary_size=30, hidden_dim=16, num_heads=2, intermediate_dim=32,
                                  num_encoder_layers=1, num_decoder_layers=1, dropout=0.0)
rng = np.random.default_rng(0)
src = rng.integers(1, 30, size=(8, 7)).astype("int32")
tgt = rng.integers(1, 30, size=(8, 6)).astype("int32")
for i in range(8):  # ragged lengths -> padding, unevenly spread over the replicas
    src[i, 7 - (i % 4):] = 0
    tgt[i, 6 - (i % 3) * 2:] = 0
dec_in = np.concatenate([np.full((8, 1), 2, "int32"), tgt[:, :-1]], axis=1)
dataset = tf.data.Dataset.from_tensor_slices(({"encoder_token_ids": src, "decoder_token_ids": dec_in}, tgt))
dataset = dataset.repeat().batch(8)  # the global batch


def run(weights_in, weights_out, optimizer="sgd", fuse_projection="fused", micro_batches="1"):
    keras.utils.clear_session()  # each job's model as in a process of its own
    # The same initial weights in every session (the "-" job's; the others load them). Adam's step is
    # m / sqrt(v): where an element's gradients are small, the rounding that differs between one replica and two
    # is scaled up, by how much depending on the start. A random start once made 3 of token_embedding's 480
    # values differ by up to 4.3e-5 in CI (atol 1e-5). FusedAdam on 2 against Adam on 1, largest difference,
    # Intel Xeon (model 207), 2 cores: seeds 0-5 6.6e-6, 8.3e-7, 1.8e-6, 7.3e-7, 1.8e-6, 1.5e-6; 8 random
    # starts 0.7-2.2e-6.
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = models.build_seq2seq(config)
        if weights_in == "-":
            model.save_weights(weights_out)
            return
        model.load_weights(weights_in)
        make = {"sgd": lambda: keras.optimizers.SGD(0.5), "adam": lambda: keras.optimizers.Adam(0.01),
                "fused_adam": lambda: FusedAdam(0.01)}[optimizer]
        # Metrics: the fused step then also hands logits to them, from each replica's own trace.
        loss = MaskedSparseCrossEntropy(0.1, fuse_projection={"fused": True, "unfused": False}[fuse_projection])
        model.compile(optimizer=make(), loss=loss, metrics=[MaskedAccuracy(), Perplexity()], jit_compile=False,
                      micro_batches=int(micro_batches))
    model.fit(dataset, steps_per_epoch=3, epochs=1, verbose=0)
    model.save_weights(weights_out)
    # Evaluation after the steps (in `micro_batches` parts per replica), for the caller to compare.
    results = model.evaluate(dataset, steps=1, verbose=0, return_dict=True)
    with open(weights_out + ".evaluate.json", "w") as handle:
        json.dump({key: float(value) for key, value in results.items()}, handle)


for job in jobs:
    run(*job)
