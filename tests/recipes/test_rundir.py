import keras
import pytest

from tfformer.recipes import language_model, rundir, translation


def test_begin_sets_the_policy_of_this_run_whatever_the_last_one_set(tmp_path):
    rundir.begin(str(tmp_path / "mixed"), mixed_precision=True)
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    rundir.begin(str(tmp_path / "plain"), mixed_precision=False)
    assert keras.config.dtype_policy().name == "float32"


@pytest.mark.parametrize("caller, mixed_precision", [("float32", True), ("mixed_bfloat16", False)])
def test_recipes_give_the_caller_its_dtype_policy_back(tmp_path, caller, mixed_precision):
    """A recipe sets its run's policy (`begin`), then fails reading its data: the caller's policy is back."""
    keras.config.set_dtype_policy(caller)
    try:
        with pytest.raises(ValueError, match="does not exist"):
            translation.train_translation(str(tmp_path / "translation"), data_file=str(tmp_path / "none.tsv"),
                                          mixed_precision=mixed_precision)
        assert keras.config.dtype_policy().name == caller
        with pytest.raises(ValueError, match="does not exist"):
            language_model.train_lm(str(tmp_path / "lm"), text_files=[str(tmp_path / "none.py")],
                                    mixed_precision=mixed_precision)
        assert keras.config.dtype_policy().name == caller
    finally:
        keras.config.set_dtype_policy("float32")
