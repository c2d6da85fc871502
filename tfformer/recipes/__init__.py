"""End-to-end jobs (train, evaluate) that use every other package; only the CLI sits above them."""
