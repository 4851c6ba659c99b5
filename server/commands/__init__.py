"""The ``vocable`` subcommands: ``serve``, ``chat``, ``call``, ``test`` and ``playbook``."""
