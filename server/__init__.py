"""The Vocable server: wires media to playbooks per call, and the ``vocable`` command."""
