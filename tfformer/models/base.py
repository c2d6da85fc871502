"""What every tfformer model shares: config handling, the embedding stack, and training with the output
projection fused with the loss."""

import collections
import inspect
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfformer import compat, generation, layers
from tfformer.compat import Untracked
from tfformer.checks import check_int
from tfformer.layers import masks
from tfformer.models import task
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


def dtype_policy(dtype):
    """`dtype` (a Keras dtype policy name, `keras.DTypePolicy` or its config) as a float `keras.DTypePolicy`; None:
    the global policy now (`keras.config.dtype_policy()`), as Keras' layers take it. Raises a ValueError naming
    `dtype` otherwise."""
    if dtype is None:
        return keras.config.dtype_policy()
    try:
        policy = keras.dtype_policies.get(dtype)
    except (TypeError, ValueError):
        policy = None
    if policy is None or not all(keras.backend.is_float_dtype(d) for d in (policy.compute_dtype,
                                                                          policy.variable_dtype)):
        raise ValueError("`dtype` must be a float Keras dtype policy name (e.g. 'float32', 'bfloat16', "
                         f"'mixed_bfloat16') or a keras.DTypePolicy. Received: dtype={dtype!r}")
    return policy


def token_ids_input(name):
    return keras.Input(shape=(None,), dtype="int32", name=name)


def padding_mask_of(token_ids):
    """`(B, T)` bool, True for real tokens (id 0 is padding)."""
    return masks.padding_mask(token_ids, 0)


def position_layer(config, name, dtype):
    if config.position == "learned":
        return layers.PositionEmbedding(
            config.max_sequence_length, initializer=kernel_initializer(config), dtype=dtype, name=name
        )
    return layers.SinusoidalPositionEncoding(dtype=dtype, name=name)


def block_kwargs(config):
    return dict(
        num_heads=config.num_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_dim=config.intermediate_dim,
        dropout=config.dropout,
        activation=config.activation,
        norm_first=config.norm_first,
        layer_norm_epsilon=config.layer_norm_epsilon,
        score=config.score,
        kernel_initializer=kernel_initializer(config),
    )


def encoder_blocks(config, dtype):
    """`config.num_encoder_layers` `EncoderBlock`s named `encoder_block_{i}`."""
    return [layers.EncoderBlock(**block_kwargs(config), dtype=dtype, name=f"encoder_block_{i}")
            for i in range(config.num_encoder_layers)]


def decoder_blocks(config, dtype, **variants):
    """`config.num_decoder_layers` `DecoderBlock`s named `decoder_block_{i}`; `variants` are DecoderBlock-only
    arguments (`cross_attention`, `normalization`, ...)."""
    return [layers.DecoderBlock(**block_kwargs(config), **variants, dtype=dtype, name=f"decoder_block_{i}")
            for i in range(config.num_decoder_layers)]


def encoder_decoder_stacks(config, dtype):
    """The layers around an encoder-decoder's embeddings: `(encoder_dropout, decoder_dropout, encoder_blocks,
    decoder_blocks, encoder_norm, decoder_norm)`, the norms None for post-LN stacks."""
    return (layers.Dropout(config.dropout, dtype=dtype, name="encoder_embedding_dropout"),
            layers.Dropout(config.dropout, dtype=dtype, name="decoder_embedding_dropout"),
            encoder_blocks(config, dtype), decoder_blocks(config, dtype),
            final_norm(config, "encoder_norm", dtype), final_norm(config, "decoder_norm", dtype))


def final_norm(config, name, dtype):
    """Pre-LN stacks end with a LayerNorm (GPT-2) or an RMSNorm (Llama); post-LN ones are already normalised."""
    if not config.norm_first:
        return None
    if config.normalization == "rms":
        return layers.RMSNorm(epsilon=config.layer_norm_epsilon, dtype=dtype, name=name)
    return layers.LayerNorm(epsilon=config.layer_norm_epsilon, dtype=dtype, name=name)


def embed_tokens(embedding, position, token_ids, start_index=0, plan=None):
    """Token embedding (scaled by sqrt(d) if configured) plus positions, `(B, T, D)`; `plan`: a decode plan
    (`layer_utils`) for the lookup."""
    x = embedding(token_ids, plan=plan)  # (B, T, D)
    return x + position(x, start_index=start_index)


def empty_cache(self, batch_size, max_length, dtype="float32"):
    """A zero self-attention key/value cache `(L, B, 2, K, max_length, H)` of a decoder task (`self`), `K` its
    key/value heads: the decoding tasks' `empty_cache` method."""
    c = self.config
    return keras.ops.zeros((c.num_decoder_layers, batch_size, 2, c.key_value_heads, max_length, c.head_dim),
                           dtype=dtype)


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


def _per_replica(value):
    """`value` divided by the replicas of the current `tf.distribute` strategy, as Keras scales a reduced loss:
    the gradients the replicas sum are then the global batch's."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return value if replicas == 1 else keras.ops.multiply(value, keras.ops.cast(1.0 / replicas, value.dtype))


def _reduce(values, reduction):
    """What `keras.losses.Loss.__call__` makes of unweighted per-token `values` `(B, T)` under `reduction`: the
    sum, or the mean over all tokens divided by the replicas."""
    total = keras.ops.sum(values)
    if reduction == "sum":
        return total
    count = keras.ops.cast(keras.ops.prod(keras.ops.convert_to_tensor(keras.ops.shape(values), "int32")), total.dtype)
    return _per_replica(keras.ops.divide_no_nan(total, count))


class _MicroBatches(keras.layers.Layer):
    """Runs `forward` on `parts` contiguous parts of a batch, independent of each other, in one call.

    One call rather than one per part: Keras clears the losses layers add (`add_loss`) when an outermost call
    starts, and every part's must still be there when the step reads `model.losses`. Not tracked by the model
    (no weights of its own; `forward`'s are the model's) and never saved, so not registered as serializable.
    """

    def __init__(self, forward, **kwargs):
        super().__init__(autocast=False, **kwargs)  # `forward` casts its own inputs
        self.forward = forward

    def call(self, inputs, parts=1, training=None):
        return [self.forward(part, training=training) for part in _split_batch(inputs, parts)]


# How one training step with the fused projection runs: the loss, and what it hands the metrics.
_FusedStep = collections.namedtuple("_FusedStep", "loss return_logits return_statistics")


def _step_graphs(model, inputs, hidden_states, projection_inputs):
    """The forward passes the training and evaluation steps run, built once per model: the graph up to the hidden
    states (the backbone) and up to the projection's inputs, functional models on the same layers."""
    def functional(outputs, name):
        graph = keras.Model(inputs, outputs, name=f"{model.name}_{name}")
        graph.dtype_policy = model.dtype_policy
        return graph

    backbone = None if hidden_states is None else functional(hidden_states, "backbone")
    hidden = None
    if projection_inputs is not None:
        hidden = backbone if projection_inputs is hidden_states else functional(projection_inputs, "hidden_states")
        hidden = _MicroBatches(hidden, dtype=model.dtype_policy, name=f"{model.name}_hidden_state_parts")
    outputs = _MicroBatches(model, dtype=model.dtype_policy, name=f"{model.name}_parts")
    return Untracked(backbone=backbone, hidden=hidden, outputs=outputs)


class TransformerModel(task.Task, keras.Model):
    """A functional `keras.Model` built from a `TransformerConfig`: a task (`models.task.Task`) whose backbone is
    the graph up to its hidden states.

    Subclasses implement `_build(config)` returning `(inputs, outputs,
    sublayers)`; `sublayers` (a dict) become attributes once the graph exists. `get_config()` is `{"config": ...}`
    so `.keras` files reload with `safe_mode=True`. A sublayer entry `hidden_states` (a symbolic tensor) is the
    backbone's output; `projection_inputs` names the inputs of a tied output projection,
    `outputs = token_embedding(projection_inputs, reverse=True)`.

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
    the same parts, prediction does not cut batches. The steps use public Keras APIs only: the graph up to the
    projection's inputs is a second functional model on the same layers, and the loss is reduced and tracked as
    Keras' own steps do (tests/training/test_fused_projection.py compares them).

    Fine-tuning with low-rank adapters (`enable_lora(rank)`, as keras-hub's `backbone.enable_lora`): adapters on
    the query, key, value and output projections of every attention layer, and only they train; `merge_lora()`
    folds them back into the kernels. `lora_rank`/`lora_alpha` are in the config, so a model saved with adapters
    (`save`, `save_to_preset`) loads with them, frozen as it was; a merged one saves as a plain model.

    Args:
        config: a `TransformerConfig` or its dict.
        lora_rank: int. If set, `enable_lora(lora_rank, lora_alpha)` once built. Defaults to `None`.
        lora_alpha: float. The adapters' scale numerator. Defaults to `None` (`lora_rank`).
        dtype: a float Keras dtype policy name (`"float32"`, `"bfloat16"`, `"mixed_bfloat16"`) or
            `keras.DTypePolicy`, given to every layer (keras-hub's `Backbone(dtype=...)`); saved with the model.
            Defaults to `None`: the global policy (`keras.config.dtype_policy()`) when the model is built.
    """

    def __init__(self, config, lora_rank=None, lora_alpha=None, dtype=None, **kwargs):
        config = as_config(config)
        dtype = dtype_policy(dtype)
        inputs, outputs, sublayers = self._build(config, dtype)
        projection_inputs = sublayers.pop("projection_inputs", None)
        hidden_states = sublayers.pop("hidden_states", None)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.dtype_policy = dtype  # Keras' functional models take no `dtype`: the policy the steps and plans read
        self.config = config
        # Named handles on the layers for incremental decoding and conversion.
        for name, layer in sublayers.items():
            setattr(self, name, layer)
        self._projection_inputs = projection_inputs  # (B, T, D) symbolic, or None
        self._step_graphs = _step_graphs(self, inputs, hidden_states, projection_inputs)
        self._compile_arguments = None
        self._adapters = None
        if lora_rank is not None:
            self.enable_lora(lora_rank, lora_alpha)

    @property
    def backbone(self):
        """The functional `keras.Model` from this task's inputs to its hidden states `(B, T, D)` (the decoder's for
        an encoder-decoder), on the task's layers."""
        if self._step_graphs.backbone is None:
            raise NotImplementedError(f"{type(self).__name__} names no hidden states")
        return self._step_graphs.backbone

    def predict(self, x, *args, **kwargs):
        """`keras.Model.predict`; `x` may also be a str or a list of str, tokenized by the preprocessor."""
        if isinstance(x, str) or (isinstance(x, (list, tuple)) and x and all(isinstance(t, str) for t in x)):
            x = self.preprocess(task.as_texts(x, "x")[0])
        return super().predict(x, *args, **kwargs)

    def preprocess(self, texts):
        """The model inputs of a list of str: `{"token_ids": (B, L) int32}` (and zero `segment_ids` when the model
        takes them)."""
        names = set(self.input) if isinstance(self.input, dict) else set()
        if not names <= {"token_ids", "segment_ids"} or "token_ids" not in names:
            raise ValueError(f"{type(self).__name__} takes {sorted(names)}, not strings.")
        tokenizer = self.require_preprocessor("preprocess")
        # A BertTokenizer is called to add [CLS]/[SEP]; the others' ids go in as they are.
        token_ids = np.asarray(tokenizer(texts)["token_ids"]) if callable(tokenizer) else self.tokenize(texts)  # (B, L)
        inputs = {"token_ids": token_ids}
        if "segment_ids" in names:
            inputs["segment_ids"] = np.zeros_like(token_ids)
        return inputs

    def _build(self, config):
        raise NotImplementedError

    # === Fine-tuning with low-rank adapters ===
    @property
    def lora_rank(self):
        """The rank of the adapters `enable_lora` added, or None."""
        return None if self._adapters is None else self._adapters.rank

    @property
    def lora_alpha(self):
        """What `enable_lora` got as `lora_alpha` (None: the rank)."""
        return None if self._adapters is None else self._adapters.lora_alpha

    def attention_layers(self):
        """Every `layers.MultiHeadAttention` of the model (self- and cross-attention), outer blocks first."""
        return [layer for layer in compat.flatten_layers(self) if isinstance(layer, layers.MultiHeadAttention)]

    def enable_lora(self, rank, lora_alpha=None):
        """Low-rank adapters (LoRA; Hu et al., 2021) of `rank` on the query, key, value and output projections of
        every attention layer (`layers.MultiHeadAttention.enable_lora`), and only they train: every other weight
        (embeddings, norms, feed-forward, the projections' kernels and biases) stops training.

        Call it before `compile` (the optimizer is built for the trainable weights it first sees) and, under a
        `tf.distribute` strategy, in the strategy's scope. `merge_lora` undoes it.

        Example:
        ```python
        lm = tfformer.models.from_preset("smollm2-135m-instruct")
        lm.enable_lora(4)
        lm.compile(optimizer=keras.optimizers.Adam(1e-3), loss=tfformer.training.MaskedSparseCrossEntropy(0.0))
        lm.fit(tfformer.data.make_chat_dataset("chat.tsv", lm.preprocessor, sequence_length=128), epochs=3)
        lm.merge_lora()
        lm.save_to_preset("smollm2-tuned")
        ```
        """
        check_int("rank", rank)
        layers.layer_utils.check_lora_alpha(lora_alpha)
        if self._adapters is not None:
            raise ValueError(f"{type(self).__name__} {self.name!r} already has adapters of rank {self.lora_rank}; "
                             "call `merge_lora()` first (then save and reload the model to add new ones).")
        attention = self.attention_layers()
        if not attention:
            raise ValueError(f"{type(self).__name__} {self.name!r} has no attention layers to adapt.")
        trainable = [weight for weight in self.weights if weight.trainable]
        for layer in attention:
            layer.enable_lora(rank, lora_alpha)
        adapters = {id(weight) for layer in attention for weight in layer.lora.weights}
        frozen = [weight for weight in trainable if id(weight) not in adapters]
        for weight in frozen:
            weight.trainable = False
        # Out of Keras' sight: the weights it stopped training are not the model's own twice.
        self._adapters = Untracked(rank=rank, lora_alpha=lora_alpha, frozen=frozen)
        self._trainable_weights_changed()

    def merge_lora(self):
        """Fold every attention layer's adapters into its kernels and delete them
        (`layers.MultiHeadAttention.merge_lora`): the same outputs from a plain model, whose weights train as
        before `enable_lora`, which decode plans lay out at full speed and which `save_to_preset` writes as a
        plain preset. Its attention layers take no new adapters (reload the model to add some)."""
        if self._adapters is None:
            raise ValueError(f"{type(self).__name__} {self.name!r} has no adapters to merge; call "
                             "`enable_lora(rank)` first.")
        for layer in self.attention_layers():
            if layer.lora_rank:
                layer.merge_lora()
        for weight in self._adapters.frozen:
            weight.trainable = True
        self._adapters = None
        self._trainable_weights_changed()

    def _trainable_weights_changed(self):
        # Generate functions traced before would keep the old kernels; a compiled step, the old trainable weights.
        generation.reset_compiled(self)
        if getattr(self, "compiled", False):
            warnings.warn("The trainable weights changed after `compile`; call `compile` again before `fit`.",
                          stacklevel=3)

    # === Training: the output projection fused with the loss ===
    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None, metrics=None, weighted_metrics=None,
                micro_batches=1, **kwargs):
        """`keras.Model.compile`, and `micro_batches`.

        Args:
            micro_batches: int >= 1. When the step fuses the output projection with the loss (see the class
                docstring), cut each batch (each replica's, under a `tf.distribute` strategy) into this many
                contiguous parts, as equal as they can be, whose forward and backward passes do not depend on
                each other, so that TensorFlow's executor runs one part's ops while another part's wait or use
                one core. The loss, the metrics and the gradients are the whole batch's (up to summation order);
                dropout draws each part's masks separately. On a CPU with few cores, 2 makes larger steps
                faster and very small ones slower (docs/performance.md); on a GPU, whose kernels run one
                after another, expect no gain. Steps that do not fuse ignore it. `evaluate` runs each
                batch's forward pass in the same parts (so it keeps both cores busy after
                `training.configure_cpu_threads`). Default 1 (no cut).
        """
        check_int("micro_batches", micro_batches, expected="an int >= 1")
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, metrics=metrics,
                        weighted_metrics=weighted_metrics, **kwargs)
        # What the steps read; out of Keras' sight, so that it does not track the metrics as the model's own.
        self._compile_arguments = Untracked(loss_weights=loss_weights, metrics=metrics,
                                            weighted_metrics=weighted_metrics, micro_batches=micro_batches)
        generation.reset_compiled(self)  # the task's compiled generate functions are rebuilt on next use

    def make_train_function(self, force=False):
        """Keras' training function (`fit` and `train_on_batch` make it), the optimizer's variables made first, as
        Keras makes them under a `tf.distribute` strategy: made while the step traces, they would make TensorFlow
        trace it twice (a `tf.function` that created variables is traced again), which for SmolLM2-135M with
        adapters costs about 25 s."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not optimizer.built and self.built:
            with self.distribute_strategy.scope():
                optimizer.build(self.trainable_variables)
        return super().make_train_function(force)

    @property
    def micro_batches(self):
        """What `compile(micro_batches=...)` got; 1 before `compile`."""
        return 1 if self._compile_arguments is None else self._compile_arguments.micro_batches

    def get_compile_config(self):
        config = super().get_compile_config()
        if config:
            config["micro_batches"] = self.micro_batches  # saved with the model, as compile's own arguments
        return config

    def compile_from_config(self, config):
        # keras.Model's version skips compiling a model whose class overrides `compile`; this one is compile's.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)  # its slots, so that saved ones load into them

    def _fused_step_for(self, x, sample_weight):
        """A `_FusedStep` if this step can fuse the projection with the compiled loss, else None."""
        loss = getattr(self, "loss", None)
        compiled = self._compile_arguments
        fusable = (
            self._projection_inputs is not None
            and compiled is not None
            and type(self).call is TransformerModel.call  # a subclass may post-process the logits
            and self.dtype_policy.compute_dtype in ("float32", "bfloat16")  # float16: see call_on_hidden_states
            and getattr(loss, "fuses_projection", False) is True
            and callable(getattr(loss, "call_on_hidden_states", None))
            and getattr(loss, "reduction", None) in ("sum_over_batch_size", "mean", "mean_with_sample_weight", "sum")
            and compiled.loss_weights is None
            and sample_weight is None
            and isinstance(x, dict)
            and set(x) == set(self.input)
        )
        if not fusable:
            return None
        metrics = [m for m in keras.tree.flatten([compiled.metrics, compiled.weighted_metrics]) if m is not None]
        statistics = all(getattr(metric, "accepts_token_statistics", False) is True for metric in metrics)
        return _FusedStep(loss, return_logits=bool(metrics) and not statistics,
                          return_statistics=bool(metrics) and statistics)

    def _track_loss(self, loss, x):
        """Keras' "loss" metric, updated as its own steps do: the whole batch's loss (not divided by the
        replicas), weighted by the batch size."""
        tracker = next(metric for metric in self.metrics if metric.name == "loss")
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        loss = loss if replicas == 1 else keras.ops.multiply(loss, keras.ops.cast(replicas, loss.dtype))
        batch = keras.ops.shape(next(t for t in keras.tree.flatten(x) if t is not None))[0]
        tracker.update_state(loss, sample_weight=batch)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = self._fused_step_for(x, sample_weight)
        if step is None:
            return super().train_step(data)
        # Keras' step with the fused loss: the same loss, reduction, scaling, gradients and metric updates.
        with tf.GradientTape() as tape:
            hidden_parts = self._step_graphs.hidden(x, parts=self.micro_batches, training=True)  # (B_i, T, D) each
            loss, metrics_input = self._fused_loss(step, y, hidden_parts)
            self._track_loss(loss, x)
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)
        if self.trainable_weights:
            gradients = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
        else:
            warnings.warn("The model does not have any trainable weights.")
        # float32 logits, a training.TokenStatistics, or None when no metrics were compiled
        return self.compute_metrics(x, y, metrics_input, sample_weight=None)

    def _fused_loss(self, step, y, hidden_parts):
        """The step's loss and what the metrics get: one projection + loss per micro-batch, on the hidden states
        the forward pass computed for it, so that each part's backward pass starts from its own loss."""
        if any(compat.keras_mask(hidden) is not None for hidden in hidden_parts):  # Keras would weight the loss by it
            raise ValueError("The fused projection + loss does not take a Keras mask on the hidden states; compile "
                             "with `MaskedSparseCrossEntropy(..., fuse_projection=False)`.")
        parts = [step.loss.call_on_hidden_states(labels, hidden, self.token_embedding.embeddings,
                                                 return_logits=step.return_logits,
                                                 return_statistics=step.return_statistics)
                 for labels, hidden in zip(_split_batch(y, len(hidden_parts)), hidden_parts)]
        if not (step.return_logits or step.return_statistics):
            parts = [(values,) for values in parts]
        values = _concatenate([part[0] for part in parts])  # (B, T)
        metrics_input = None
        if step.return_statistics:
            statistics = type(parts[0][1])  # the loss's training.TokenStatistics
            metrics_input = statistics(
                _concatenate([part[1].cross_entropy for part in parts]),  # (B, T)
                _concatenate([part[1].correct for part in parts]))  # (B, T)
        elif step.return_logits:
            metrics_input = _concatenate([part[1] for part in parts])  # (B, T, V)
        total = _reduce(values, step.loss.reduction)
        # Losses the forward pass added (activity regularizers, add_loss), as Keras' compute_loss adds them.
        extra = [_per_replica(keras.ops.sum(_as_float(loss))) for loss in self.losses]
        return keras.ops.sum([total] + extra), metrics_input

    def test_step(self, data):
        """Keras' evaluation step; with `compile(..., micro_batches=k)`, k > 1, the forward pass runs on k
        contiguous parts of the batch, independent of each other, whose outputs are concatenated before the loss
        and the metrics (so they are the whole batch's), as the training step's parts run side by side."""
        if self.micro_batches == 1:
            return super().test_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        outputs = self._step_graphs.outputs(x, parts=self.micro_batches, training=False)
        y_pred = keras.tree.map_structure(lambda *pieces: _concatenate(list(pieces)), *outputs)  # (B, ...)
        if "training" in inspect.signature(self.compute_loss).parameters:
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
        else:
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        self._track_loss(loss, x)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def get_config(self):
        return {"config": self.config.to_dict(), "lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha,
                "dtype": keras.dtype_policies.serialize(self.dtype_policy), "name": self.name,
                "trainable": self.trainable}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _as_float(loss):
    return loss if keras.backend.is_float_dtype(loss.dtype) else keras.ops.cast(loss, keras.backend.floatx())
