"""The `tfformer` command. Glue only: every piece of logic lives in the library."""

import argparse
import sys


def _demo(args):
    import numpy as np

    from tfformer import models

    print("tfformer demo: building every preset and running one forward pass.")
    for name in models.list_presets():
        config = models.get_preset(name)
        model = models.build_model(config)
        ids = np.random.default_rng(0).integers(1, config.vocabulary_size, size=(1, 8)).astype("int32")
        inputs = {"seq2seq": {"encoder_token_ids": ids, "decoder_token_ids": ids}}.get(config.architecture, {"token_ids": ids})
        if config.num_segments:
            inputs["segment_ids"] = np.zeros_like(ids)
        outputs = model(inputs, training=False)
        shapes = {k: tuple(v.shape) for k, v in outputs.items()} if isinstance(outputs, dict) else tuple(outputs.shape)
        print(f"  {name:18s} {config.architecture:10s} params={model.count_params():>12,d}  output={shapes}")
    return 0


def _presets(args):
    from tfformer import models

    for name in models.list_presets():
        print(name, models.get_preset(name).to_json().replace("\n", " "))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tfformer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="the main job (for now: build every preset and run it once)").set_defaults(fn=_demo)
    commands.add_parser("presets", help="list the preset zoo").set_defaults(fn=_presets)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as error:
        print(f"tfformer: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
