"""Settings of the ``vocable`` command: ``vocable serve``'s, the LLM endpoint, and flag types."""
