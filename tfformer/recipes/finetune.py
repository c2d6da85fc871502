"""Fine-tuning a pretrained causal LM on chat pairs or plain text, saved as a preset."""

import keras

from tfformer import data, models, training
from tfformer.checks import check_int, check_number
from tfformer.models.task import check_preset_target


def finetune_lm(out, preset="smollm2-135m-instruct", chat=None, text=None, lora_rank=4, steps=100, batch_size=8,
                sequence_length=256, learning_rate=2e-4, system_prompt=None, replicas=None, overwrite=False):
    """Fine-tune the causal LM of `preset` (a name or a preset directory) and save it as a preset at `out`.

    The examples are `chat`, a file of `prompt<TAB>answer` lines (`data.make_chat_dataset`: the loss on the
    answers), or `text`, a UTF-8 file of one example per non-blank line (`data.make_text_file_dataset`): exactly
    one of them. `lora_rank > 0` trains low-rank adapters on the attention projections only and merges them into
    the kernels before saving, so the preset is a plain model that exports and serves as the base one does;
    `lora_rank=0` trains every weight. Adam at `learning_rate`, `steps` batches of `batch_size`, under
    `training.get_strategy(replicas)` (call it in a process where no tensor exists yet for `replicas` CPU devices).
    Returns the loss of each step.
    """
    if (chat is None) == (text is None):
        raise ValueError(f"Pass exactly one of `chat` (prompt<TAB>answer lines) and `text` (a text file). "
                         f"Received: chat={chat!r}, text={text!r}")
    check_int("lora_rank", lora_rank, minimum=0, expected="an integer >= 0 (0: every weight trains)")
    check_int("steps", steps)
    check_int("batch_size", batch_size)
    check_int("sequence_length", sequence_length, minimum=2, expected="an integer >= 2 (a token and its next)")
    check_number("learning_rate", learning_rate, above=0)  # a negative one climbs the loss, and saves that
    check_preset_target(out, overwrite)  # before the training, not after it
    strategy = training.get_strategy(replicas)
    with strategy.scope():
        lm = models.from_preset(preset)
        if not isinstance(lm, models.CausalLM) or lm.preprocessor is None:
            raise ValueError(f"`preset` must be a causal LM with a tokenizer (e.g. 'smollm2-135m-instruct', or a "
                             f"preset directory of one). Received: preset={preset!r}, a {type(lm).__name__}")
        if lora_rank:
            lm.enable_lora(lora_rank)
        lm.compile(optimizer=keras.optimizers.Adam(learning_rate), loss=training.MaskedSparseCrossEntropy(0.0),
                   jit_compile=False)
    if chat is not None:
        dataset = data.make_chat_dataset(chat, lm.preprocessor, sequence_length=sequence_length,
                                         batch_size=batch_size, system_prompt=system_prompt)
    else:
        dataset = data.make_text_file_dataset(text, lm.preprocessor, sequence_length=sequence_length,
                                              batch_size=batch_size)
    # One step per epoch: the history holds each step's loss.
    losses = lm.fit(dataset.repeat(), steps_per_epoch=1, epochs=steps, verbose=0).history["loss"]
    if lora_rank:
        lm.merge_lora()
    lm.save_to_preset(out, overwrite=overwrite)
    return losses
