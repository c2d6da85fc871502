"""What every tfformer model shares: config handling, the embedding stack, and training with the output
projection fused with the loss."""

import threading

import keras
from keras.src.losses import loss as keras_loss  # see TransformerModel.compute_loss
from keras.src.models import functional as keras_functional  # see TransformerModel.call

from tfformer import layers
from tfformer.layers import masks
from tfformer.models.config import TransformerConfig


def as_config(config):
    if isinstance(config, TransformerConfig):
        return config
    if isinstance(config, dict):
        return TransformerConfig.from_dict(config)
    raise ValueError(f"`config` must be a TransformerConfig or a dict. Received: config={config!r}")


def kernel_initializer(config):
    if config.initializer_range is None:
        return "glorot_uniform"
    return keras.initializers.TruncatedNormal(stddev=config.initializer_range)


def token_ids_input(name):
    return keras.Input(shape=(None,), dtype="int32", name=name)


def padding_mask_of(token_ids):
    """`(B, T)` bool, True for real tokens (id 0 is padding)."""
    return masks.padding_mask(token_ids, 0)


def position_layer(config, name):
    if config.position == "learned":
        return layers.PositionEmbedding(
            config.max_sequence_length, initializer=kernel_initializer(config), name=name
        )
    return layers.SinusoidalPositionEncoding(name=name)


def block_kwargs(config):
    return dict(
        num_heads=config.num_heads,
        intermediate_dim=config.intermediate_dim,
        dropout=config.dropout,
        activation=config.activation,
        norm_first=config.norm_first,
        layer_norm_epsilon=config.layer_norm_epsilon,
        score=config.score,
        kernel_initializer=kernel_initializer(config),
    )


def final_norm(config, name):
    """Pre-LN stacks end with a LayerNorm (GPT-2); post-LN ones are already normalised."""
    if not config.norm_first:
        return None
    return layers.LayerNorm(epsilon=config.layer_norm_epsilon, name=name)


def embed_tokens(embedding, position, token_ids, start_index=0):
    """Token embedding (scaled by sqrt(d) if configured) plus positions, `(B, T, D)`."""
    x = embedding(token_ids)  # (B, T, D)
    return x + position(x, start_index=start_index)


def _split_batch(structure, parts):
    """`parts` structures like `structure`, its tensors cut along the batch axis into contiguous pieces of
    `B // parts` or `B // parts + 1` rows (empty ones when B < parts)."""
    if parts == 1:
        return [structure]
    batch = keras.ops.shape(keras.tree.flatten(structure)[0])[0]
    bounds = [i * batch // parts for i in range(parts + 1)]
    return [keras.tree.map_structure(lambda t, i=i: t[bounds[i]:bounds[i + 1]], structure) for i in range(parts)]


def _concatenate(tensors):
    """`_split_batch`'s inverse for a list of tensors."""
    return tensors[0] if len(tensors) == 1 else keras.ops.concatenate(tensors, axis=0)


_TRACING = threading.local()  # per thread: {id(model): _FusedStep}; a strategy traces each replica in a thread


class _FusedStep:
    """What one traced training step with the fused projection passes from `call` to `compute_loss` and
    `compute_metrics`."""

    def __init__(self, loss, return_logits, return_statistics):
        self.loss, self.return_logits, self.return_statistics = loss, return_logits, return_statistics
        self.metrics_input = None  # what compute_metrics hands the compiled metrics: logits, statistics or None
        self.hidden_parts = None  # the projection's inputs `call` computed, one `(B_i, T, D)` per micro-batch


class TransformerModel(keras.Model):
    """A functional `keras.Model` built from a `TransformerConfig`.

    Subclasses implement `_build(config)` returning `(inputs, outputs,
    sublayers)`; `sublayers` (a dict) become attributes once the graph exists. `get_config()` is `{"config": ...}`
    so `.keras` files reload with `safe_mode=True`. A sublayer entry `projection_inputs` (a symbolic tensor) names
    the inputs of a tied output projection, `outputs = token_embedding(projection_inputs, reverse=True)`.

    Training with the output projection fused with the loss: when the model was compiled with one loss that offers
    `call_on_hidden_states` and `fuses_projection` (`training.MaskedSparseCrossEntropy`), no `loss_weights`, a
    float32 or mixed_bfloat16 policy, and `fit` gives no sample weights, `train_step` runs the model up to the
    projection's inputs and lets the loss compute the projection, the loss and their gradients as one operation (no
    float32 logits under mixed precision). The loss, its reduction and the gradients are those of the unfused step;
    the compiled metrics get per-token statistics from the loss's pass over the logits when they all take them
    (`accepts_token_statistics`: `training.MaskedAccuracy`, `training.Perplexity`), else the float32 logits; without
    compiled metrics no float32 logits are made. With `compile(..., micro_batches=k)`, k > 1, the fused step cuts
    the batch into k contiguous parts that run the model, the loss and their gradients independently, so that
    TensorFlow's executor runs them side by side (see `compile`); evaluation (`test_step`) runs its forward pass in
    the same parts, prediction does not cut batches. This relies on private parts of Keras 3.15 (the Functional
    graph walk `_run_through_graph` with `functional.operation_fn`, the losses' `reduce_values`, and
    `_compile_config`); tests/training/test_fused_projection.py fails if an update changes them.
    """

    def __init__(self, config, **kwargs):
        config = as_config(config)
        inputs, outputs, sublayers = self._build(config)
        projection_inputs = sublayers.pop("projection_inputs", None)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.config = config
        # Named handles on the layers for incremental decoding and conversion.
        for name, layer in sublayers.items():
            setattr(self, name, layer)
        self._projection_inputs = projection_inputs  # (B, T, D) symbolic, or None

    def _build(self, config):
        raise NotImplementedError

    # === Training: the output projection fused with the loss ===
    def compile(self, *args, micro_batches=1, **kwargs):
        """`keras.Model.compile`, and `micro_batches`.

        Args:
            micro_batches: int >= 1. When the step fuses the output projection with the loss (see the class
                docstring), cut each batch (each replica's, under a `tf.distribute` strategy) into this many
                contiguous parts, as equal as they can be, whose forward and backward passes do not depend on
                each other, so that TensorFlow's executor runs one part's ops while another part's wait or use
                one core. The loss, the metrics and the gradients are the whole batch's (up to summation order);
                dropout draws each part's masks separately. Measured on a 2-core CPU (benchmarks/RESULTS.md):
                2 makes the benchmark LM's steps (32 x 128 tokens) 5-10% faster and the seq2seq model's
                (64 x 64) 1-5%, and `transformer-tiny`'s (64 x 16) 5% slower; on a GPU, whose kernels run
                one after another, expect no gain. Steps that do not fuse ignore it. `evaluate` runs each
                batch's forward pass in the same parts (so it keeps both cores busy after
                `training.configure_cpu_threads`). Default 1 (no cut).
        """
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"`micro_batches` must be an int >= 1. Received: micro_batches={micro_batches!r}")
        super().compile(*args, **kwargs)
        self._compile_config.config["micro_batches"] = micro_batches  # saved with the model, as compile's own

    @property
    def micro_batches(self):
        """What `compile(micro_batches=...)` got; 1 before `compile`."""
        return self._compiled_arguments().get("micro_batches", 1)

    def compile_from_config(self, config):
        # keras.Model's version skips compiling a model whose class overrides `compile`; this one is compile's.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)  # its slots, so that saved ones load into them

    @property
    def _fused_step(self):
        """The `_FusedStep` this thread is tracing for this model, or None. Per thread: MirroredStrategy traces
        its replicas' steps concurrently, one thread each."""
        return getattr(_TRACING, "steps", {}).get(id(self))

    def _compiled_arguments(self):
        """The arguments `compile()` got, as given (`get_compile_config()` serializes them, which needs eager
        execution; a traced step is not)."""
        compile_config = getattr(self, "_compile_config", None)
        return dict(getattr(compile_config, "config", None) or {})

    def _fused_step_for(self, x, sample_weight):
        """A `_FusedStep` if this step can fuse the projection with the compiled loss, else None."""
        loss = getattr(self, "loss", None)
        compiled = self._compiled_arguments()
        fusable = (
            self._projection_inputs is not None
            and type(self).call is TransformerModel.call  # a subclass may post-process the logits
            and self.dtype_policy.compute_dtype in ("float32", "bfloat16")  # float16: see call_on_hidden_states
            and getattr(loss, "fuses_projection", False) is True
            and callable(getattr(loss, "call_on_hidden_states", None))
            and getattr(loss, "reduction", None) in ("sum_over_batch_size", "mean", "mean_with_sample_weight", "sum")
            and compiled.get("loss_weights") is None
            and sample_weight is None
            and isinstance(x, dict)
            and set(x) == set(self.input)
        )
        if not fusable:
            return None
        metrics = [m for m in keras.tree.flatten([compiled.get("metrics"), compiled.get("weighted_metrics")])
                   if m is not None]
        statistics = all(getattr(metric, "accepts_token_statistics", False) is True for metric in metrics)
        return _FusedStep(loss, return_logits=bool(metrics) and not statistics,
                          return_statistics=bool(metrics) and statistics)

    def train_step(self, data):
        x, _, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = self._fused_step_for(x, sample_weight)
        if step is None:
            return super().train_step(data)
        steps = _TRACING.__dict__.setdefault("steps", {})
        steps[id(self)] = step
        try:
            return super().train_step(data)  # Keras' step; call, compute_loss and compute_metrics see _fused_step
        finally:
            del steps[id(self)]

    def test_step(self, data):
        """Keras' evaluation step; with `compile(..., micro_batches=k)`, k > 1, the forward pass runs on k
        contiguous parts of the batch, independent of each other, whose outputs are concatenated before the loss
        and the metrics (so they are the whole batch's), as the training step's parts run side by side."""
        if self.micro_batches == 1:
            return super().test_step(data)
        evaluating = _TRACING.__dict__.setdefault("evaluating", set())
        evaluating.add(id(self))
        try:
            return super().test_step(data)
        finally:
            evaluating.discard(id(self))

    def call(self, inputs, training=None, mask=None):
        # Keras hands `call` its inputs' masks as a structure of Nones when they have none.
        if id(self) in getattr(_TRACING, "evaluating", ()) and all(m is None for m in keras.tree.flatten(mask)):
            parts = _split_batch(inputs, self.micro_batches)  # the inputs' own structure, which Functional.call takes
            outputs = [super(TransformerModel, self).call(part, training=training) for part in parts]
            return keras.tree.map_structure(lambda *pieces: _concatenate(list(pieces)), *outputs)  # (B, ...)
        if self._fused_step is not None:
            # The graph up to the projection's inputs, walked as Functional.call walks the whole graph: the
            # nodes recorded their layers' default `training`, which the walk overrides.
            hidden = keras.Function(self.input, self._projection_inputs)
            parts = _split_batch(self._standardize_inputs(inputs), self.micro_batches)
            self._fused_step.hidden_parts = [
                hidden._run_through_graph(  # (B_i, T, D)
                    part, operation_fn=lambda op: keras_functional.operation_fn(op, training=training))
                for part in parts
            ]
            # For Keras' step, which hands it to compute_loss and compute_metrics; they read the parts and the
            # metrics input instead, so nothing consumes it (a (B, T, D) copy at most).
            return _concatenate(self._fused_step.hidden_parts)  # (B, T, D)
        return super().call(inputs, training=training, mask=mask)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        step = self._fused_step
        if step is None:
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        # y_pred: the projection's inputs (B, T, D), from `call`.
        if getattr(y_pred, "_keras_mask", None) is not None:  # Keras would weight the loss by it; ours has none
            raise ValueError("The fused projection + loss does not take a Keras mask on the hidden states; compile "
                             "with `MaskedSparseCrossEntropy(..., fuse_projection=False)`.")
        # One projection + loss per micro-batch, on the hidden states `call` computed for it (y_pred is their
        # concatenation), so that each part's backward pass starts from its own loss.
        parts = [step.loss.call_on_hidden_states(labels, hidden, self.token_embedding.embeddings,
                                                 return_logits=step.return_logits,
                                                 return_statistics=step.return_statistics)
                 for labels, hidden in zip(_split_batch(y, len(step.hidden_parts)), step.hidden_parts)]
        if not (step.return_logits or step.return_statistics):
            parts = [(values,) for values in parts]
        values = _concatenate([part[0] for part in parts])  # (B, T)
        if step.return_statistics:
            statistics = type(parts[0][1])  # the loss's training.TokenStatistics
            step.metrics_input = statistics(
                _concatenate([part[1].cross_entropy for part in parts]),  # (B, T)
                _concatenate([part[1].correct for part in parts]))  # (B, T)
        elif step.return_logits:
            step.metrics_input = _concatenate([part[1] for part in parts])  # (B, T, V)
        # Keras' own reduction of unweighted values (what keras.losses.Loss.__call__ applies), including its
        # 1/replicas scaling under a tf.distribute strategy.
        total = keras_loss.reduce_values(values, reduction=step.loss.reduction)
        # Losses the forward pass added (activity regularizers, add_loss), as Keras' compute_loss adds them.
        return keras.ops.sum([total] + [self._aggregate_additional_loss(extra) for extra in self.losses])

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        if self._fused_step is not None:
            # float32 logits, a training.TokenStatistics, or None when no metrics were compiled
            y_pred = self._fused_step.metrics_input
        return super().compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def get_config(self):
        return {"config": self.config.to_dict(), "name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config):
        return cls(**config)
