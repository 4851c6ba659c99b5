"""What the tests share: stand-in servers, real peers' wrappers, speech and calls."""
