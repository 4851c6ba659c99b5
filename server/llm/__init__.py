"""The LLM supply: which LLM the calls talk to (an endpoint, a local server found, or llama.cpp
in process), GGUF files, and the default model fetched once."""
