import keras
import pytest

from tfformer.recipes import language_model, rundir, translation


def test_begin_gives_the_runs_policy_and_leaves_the_global_one(tmp_path):
    keras.config.set_dtype_policy("bfloat16")  # a caller's (the autouse fixture puts float32 back)
    _, _, dtype = rundir.begin(str(tmp_path / "mixed"), mixed_precision=True)
    assert dtype.name == "mixed_bfloat16" and keras.config.dtype_policy().name == "bfloat16"
    _, _, dtype = rundir.begin(str(tmp_path / "plain"), mixed_precision=False)
    assert dtype.name == "float32" and keras.config.dtype_policy().name == "bfloat16"


@pytest.mark.parametrize("caller, mixed_precision", [("float32", True), ("mixed_bfloat16", False)])
def test_recipes_give_the_caller_its_dtype_policy_back(tmp_path, caller, mixed_precision, monkeypatch):
    """A recipe that fails once its run has begun (here: learning its vocabulary) leaves the caller's global policy
    as it was."""
    def fail(*args, **kwargs):
        raise ValueError("stopped after rundir.begin")

    monkeypatch.setattr(translation, "_run_tokenizer", fail)
    monkeypatch.setattr(language_model.data.SubwordTokenizer, "train", fail)
    (tmp_path / "pairs.tsv").write_text("".join(f"open {i}\tôffnen {i}\n" for i in range(40)), encoding="utf-8")
    (tmp_path / "text.py").write_text("".join(f"x = {i}\n" for i in range(40)))
    keras.config.set_dtype_policy(caller)
    try:
        with pytest.raises(ValueError, match="stopped after rundir.begin"):
            translation.train_translation(str(tmp_path / "translation"), data_file=str(tmp_path / "pairs.tsv"),
                                          mixed_precision=mixed_precision)
        assert keras.config.dtype_policy().name == caller
        with pytest.raises(ValueError, match="stopped after rundir.begin"):
            language_model.train_lm(str(tmp_path / "lm"), text_files=[str(tmp_path / "text.py")],
                                    mixed_precision=mixed_precision)
        assert keras.config.dtype_policy().name == caller
        assert (tmp_path / "translation").is_dir() and (tmp_path / "lm").is_dir()  # both runs had begun
    finally:
        keras.config.set_dtype_policy("float32")
