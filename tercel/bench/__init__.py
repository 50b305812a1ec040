"""`tercel bench`: offline sweeps through the Python API and a load generator for OpenAI-compatible servers."""
